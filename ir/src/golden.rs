//! Golden-file checks for tests across kiln's crates.
//!
//! Why it exists: printed graphs, DOT dumps and plan dumps are reviewed as
//! text, and a change to any of them must be a deliberate, visible diff. A
//! test calls [`check_golden`] with the file and what it produced now; the
//! test fails (with a line diff) when they differ, and fails when the file is
//! missing. Running the tests with `KILN_BLESS=1` writes the current output
//! instead (through a temporary file renamed into place, creating folders as
//! needed), for the author to review and commit.
//!
//! Paths are taken as given; tests usually build them from
//! `env!("CARGO_MANIFEST_DIR")` so they work from any working directory.
//! Line endings of the stored file are normalized (`\r\n` reads as `\n`) so a
//! checkout with converted newlines still compares equal.
//!
//! Not here: any formatting of what is compared (callers print their own
//! text), binary goldens.

use std::fmt::Write as _;
use std::path::Path;

/// Compares `actual` with the golden file at `path`, or writes it there when
/// the environment has `KILN_BLESS=1`.
///
/// # Panics
/// When the file is missing or differs (with a diff and the command that
/// refreshes it), or when blessing cannot write it. It is a test assertion.
pub fn check_golden(path: &Path, actual: &str) {
    let bless = std::env::var("KILN_BLESS").is_ok_and(|v| v == "1");
    if let Err(msg) = check(path, actual, bless) {
        panic!("{msg}");
    }
}

fn bless_hint() -> String {
    // Cargo sets CARGO_PKG_NAME when it runs a test binary.
    match std::env::var("CARGO_PKG_NAME") {
        Ok(pkg) if !pkg.is_empty() => format!("KILN_BLESS=1 cargo test -p {pkg}"),
        _ => "KILN_BLESS=1 cargo test ...".to_string(),
    }
}

/// The non-panicking core of [`check_golden`].
fn check(path: &Path, actual: &str, bless: bool) -> Result<(), String> {
    let existing = match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("cannot read golden file {}: {e}", path.display())),
    };
    if bless {
        if existing.as_deref() == Some(actual.as_bytes()) {
            return Ok(());
        }
        return write_atomically(path, actual)
            .map_err(|e| format!("cannot write golden file {}: {e}", path.display()));
    }
    let Some(bytes) = existing else {
        return Err(format!(
            "golden file {} does not exist; run `{}` to create it, then review and commit it",
            path.display(),
            bless_hint()
        ));
    };
    let Ok(expected) = String::from_utf8(bytes) else {
        return Err(format!(
            "golden file {} is not UTF-8 text; run `{}` to rewrite it",
            path.display(),
            bless_hint()
        ));
    };
    let expected = expected.replace("\r\n", "\n");
    if expected == actual {
        return Ok(());
    }
    Err(format!(
        "golden file {} differs from the actual output\n{}\nIf the change is intended, run `{}` and review the diff before committing.",
        path.display(),
        diff_summary(&expected, actual),
        bless_hint()
    ))
}

fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "golden".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Most diff lines shown before the rest is summarized.
const MAX_SHOWN: usize = 60;
/// Context lines around each change.
const CONTEXT: usize = 2;
/// Largest table the line LCS may build; past it, the differing middle is
/// shown as one replaced block.
const MAX_CELLS: usize = 4_000_000;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Edit {
    Same,
    Del,
    Add,
}

/// A readable summary of how `actual` differs from `expected`: line counts,
/// the first differing line, and a line diff (`-` golden, `+` actual) with
/// context, capped at [`MAX_SHOWN`] lines.
pub(crate) fn diff_summary(expected: &str, actual: &str) -> String {
    let e: Vec<&str> = expected.split('\n').collect();
    let a: Vec<&str> = actual.split('\n').collect();
    // Trim the common prefix and suffix, then diff the middle.
    let pre = e.iter().zip(&a).take_while(|(x, y)| x == y).count();
    let max_suf = e.len().min(a.len()) - pre;
    let suf = e
        .iter()
        .rev()
        .zip(a.iter().rev())
        .take(max_suf)
        .take_while(|(x, y)| x == y)
        .count();
    let (em, am) = (&e[pre..e.len() - suf], &a[pre..a.len() - suf]);
    let mut script: Vec<(Edit, usize, usize)> = (0..pre).map(|i| (Edit::Same, i, i)).collect();
    for (op, i, j) in lcs_script(em, am) {
        script.push((op, i + pre, j + pre));
    }
    for k in 0..suf {
        script.push((Edit::Same, e.len() - suf + k, a.len() - suf + k));
    }

    let mut out = String::new();
    let _ = writeln!(
        out,
        "golden has {} line(s), actual has {}; first difference at line {}",
        e.len(),
        a.len(),
        pre + 1
    );
    // Mark which script entries to show: changes and their context.
    let keep: Vec<bool> = (0..script.len())
        .map(|k| {
            let lo = k.saturating_sub(CONTEXT);
            let hi = (k + CONTEXT + 1).min(script.len());
            script[lo..hi].iter().any(|s| s.0 != Edit::Same)
        })
        .collect();
    let mut shown = 0;
    let mut hidden_changes = 0;
    let mut prev_kept = false;
    for (k, &(op, i, j)) in script.iter().enumerate() {
        if !keep[k] {
            prev_kept = false;
            continue;
        }
        if shown >= MAX_SHOWN {
            if op != Edit::Same {
                hidden_changes += 1;
            }
            continue;
        }
        if !prev_kept {
            let _ = writeln!(out, "@@ golden line {}, actual line {} @@", i + 1, j + 1);
        }
        prev_kept = true;
        let line = match op {
            Edit::Same => format!("   {}", e[i]),
            Edit::Del => format!(" - {}", e[i]),
            Edit::Add => format!(" + {}", a[j]),
        };
        out.push_str(&line);
        out.push('\n');
        shown += 1;
    }
    if hidden_changes > 0 {
        let _ = writeln!(out, "... and {hidden_changes} more changed line(s)");
    }
    out
}

/// An edit script turning `e` into `a`: `(edit, index in e, index in a)`,
/// the index of the side the edit does not touch being where it stands.
fn lcs_script(e: &[&str], a: &[&str]) -> Vec<(Edit, usize, usize)> {
    let (n, m) = (e.len(), a.len());
    if n.saturating_mul(m) > MAX_CELLS {
        let mut s: Vec<_> = (0..n).map(|i| (Edit::Del, i, 0)).collect();
        s.extend((0..m).map(|j| (Edit::Add, n, j)));
        return s;
    }
    // len[i][j]: LCS length of e[i..] and a[j..].
    let w = m + 1;
    let mut len = vec![0u32; (n + 1) * w];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            len[i * w + j] = if e[i] == a[j] {
                len[(i + 1) * w + j + 1] + 1
            } else {
                len[(i + 1) * w + j].max(len[i * w + j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut s = vec![];
    while i < n || j < m {
        if i < n && j < m && e[i] == a[j] {
            s.push((Edit::Same, i, j));
            i += 1;
            j += 1;
        } else if i < n && (j == m || len[(i + 1) * w + j] >= len[i * w + j + 1]) {
            // Deletions first, so a changed line reads `-` old then `+` new.
            s.push((Edit::Del, i, j));
            i += 1;
        } else {
            s.push((Edit::Add, i, j));
            j += 1;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn scratch(name: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        std::env::temp_dir().join(format!("kiln-golden-{}-{nanos}-{name}", std::process::id()))
    }

    #[test]
    fn a_missing_golden_fails_with_the_bless_command() {
        let dir = scratch("missing");
        let err = check(&dir.join("g.txt"), "text\n", false).unwrap_err();
        assert!(err.contains("does not exist"), "{err}");
        assert!(err.contains("KILN_BLESS=1 cargo test"), "{err}");
        assert!(!dir.exists());
    }

    #[test]
    fn blessing_creates_folders_and_then_the_same_text_passes() {
        let dir = scratch("bless");
        let path = dir.join("a/b/g.txt");
        check(&path, "line one\nline two\n", true).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "line one\nline two\n"
        );
        check(&path, "line one\nline two\n", false).unwrap();
        // No temporary file is left next to it.
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("g.txt")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_changed_output_fails_with_a_diff_naming_the_changed_line() {
        let dir = scratch("changed");
        let path = dir.join("g.txt");
        let old: String = (0..30).map(|i| format!("line {i}\n")).collect();
        check(&path, &old, true).unwrap();
        let new = old.replace("line 17\n", "line 17 changed\n");
        let err = check(&path, &new, false).unwrap_err();
        assert!(err.contains("first difference at line 18"), "{err}");
        assert!(err.contains(" - line 17\n"), "{err}");
        assert!(err.contains(" + line 17 changed\n"), "{err}");
        assert!(!err.contains("line 3\n"), "context is bounded: {err}");
        assert!(err.contains("KILN_BLESS=1 cargo test"), "{err}");
        // Blessing replaces it.
        check(&path, &new, true).unwrap();
        check(&path, &new, false).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn crlf_goldens_compare_equal_to_lf_output() {
        let dir = scratch("crlf");
        let path = dir.join("g.txt");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, "a\r\nb\r\n").unwrap();
        check(&path, "a\nb\n", false).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_diff_pairs_insertions_and_deletions_by_common_lines() {
        let d = diff_summary("a\nb\nc\nd\n", "a\nx\nc\nd\ny\n");
        assert!(d.contains(" - b\n + x\n"), "{d}");
        assert!(d.contains(" + y\n"), "{d}");
        assert!(d.contains("golden has 5 line(s), actual has 6"), "{d}");
    }

    #[test]
    fn huge_diffs_are_capped() {
        let old: String = (0..500).map(|i| format!("{i}\n")).collect();
        let new: String = (0..500).map(|i| format!("{}\n", i * 7 + 1)).collect();
        let d = diff_summary(&old, &new);
        assert!(d.lines().count() < MAX_SHOWN + 10, "{d}");
        assert!(d.contains("more changed line(s)"), "{d}");
    }
}
