//! `kiln compile`'s limits on keys, context, KV blocks and plan memory:
//! each absurd option is refused before anything is traced or sized from
//! it, and the message names the flag, the offending value and the limit.

use kiln_compiler::compile::{
    compile_dir, kv_layout, normalize_keys, parse_size, CompileError, CompileOptions, KvOptions,
    COMPILE_LIMITS,
};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::plan::ModelInfo;
use kiln_ir::{DType, Key};

fn refused(keys: &[Key]) -> String {
    match normalize_keys(keys) {
        Err(CompileError::Options(m)) => m,
        other => panic!("{keys:?} was not refused: {other:?}"),
    }
}

fn info(layers: u32, kv_heads: u32, head_dim: u32, max_context: u32) -> ModelInfo {
    ModelInfo {
        vocab_size: 256,
        hidden_size: kv_heads * head_dim,
        num_layers: layers,
        num_heads: kv_heads,
        num_kv_heads: kv_heads,
        head_dim,
        max_context,
        bos_token_id: None,
        eos_token_ids: vec![],
        dtype: DType::BF16,
    }
}

#[test]
fn keys_above_each_limit_are_refused_naming_the_flag_the_value_and_the_limit() {
    let l = COMPILE_LIMITS;
    let m = refused(&["b100000q1s0".parse().unwrap()]);
    assert!(
        m.contains("batch 100000") && m.contains(&l.batch.to_string()),
        "{m}"
    );
    assert!(m.contains("--batches"), "{m}");
    let m = refused(&[Key::new(1, u32::MAX, 0)]);
    assert!(
        m.contains(&format!("query {}", u32::MAX)) && m.contains("--query"),
        "{m}"
    );
    let m = refused(&[Key::new(1, 100, 99)]);
    assert!(m.contains("spec 99") && m.contains("--spec"), "{m}");
    // Each within its own limit, too many tokens together.
    let m = refused(&[Key::new(l.batch, l.query, 0)]);
    let tokens = l.batch as u64 * l.query as u64;
    assert!(m.contains(&format!("{tokens} tokens per step")), "{m}");
    let many: Vec<Key> = (1..=l.keys as u32 + 1).map(|b| Key::new(b, 1, 0)).collect();
    let m = refused(&many);
    assert!(m.contains(&format!("{} shape keys", l.keys + 1)), "{m}");
    // At the limits exactly: accepted.
    let at: Vec<Key> = (1..=l.keys as u32).map(|b| Key::new(b, 1, 0)).collect();
    assert_eq!(normalize_keys(&at).unwrap().len(), l.keys);
    normalize_keys(&[Key::new(l.step_tokens / l.query, l.query, l.spec)]).unwrap();
}

#[test]
fn a_query_longer_than_the_context_is_refused_at_compile() {
    let keys = [Key::new(1, 128, 0)];
    let kv = KvOptions {
        max_context: Some(64),
        ..KvOptions::default()
    };
    let e = kv_layout(&info(2, 2, 16, 512), &kv, &keys).unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("query 128") && m.contains("context of 64"),
        "{m}"
    );
    // The model's own limit counts too.
    let kv = KvOptions {
        max_context: Some(4096),
        ..KvOptions::default()
    };
    let m = kv_layout(&info(2, 2, 16, 100), &kv, &keys)
        .unwrap_err()
        .to_string();
    assert!(m.contains("context of 100"), "{m}");
    assert!(kv_layout(&info(2, 2, 16, 128), &kv, &keys).is_ok());
}

#[test]
fn max_context_and_block_size_above_their_limits_are_refused_by_flag() {
    let l = COMPILE_LIMITS;
    let keys = [Key::new(1, 1, 0)];
    let kv = KvOptions {
        max_context: Some(l.max_context + 1),
        ..KvOptions::default()
    };
    let m = kv_layout(&info(2, 2, 16, u32::MAX), &kv, &keys)
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("--max-context") && m.contains(&(l.max_context + 1).to_string()),
        "{m}"
    );
    let kv = KvOptions {
        block_size: l.block_size + 1,
        ..KvOptions::default()
    };
    let m = kv_layout(&info(2, 2, 16, 512), &kv, &keys)
        .unwrap_err()
        .to_string();
    assert!(m.contains("--block-size"), "{m}");
}

#[test]
fn a_kv_cache_larger_than_any_device_is_refused_before_allocation() {
    let keys = [Key::new(1, 1, 0)];
    // 128 layers x 8 kv heads x 128 dims x bf16 x K and V = 512 KiB per
    // token: 2^21 usable tokens is 1 TiB, 2^21 + 1024 is just above.
    let big = info(128, 8, 128, 1 << 21);
    let at = KvOptions {
        kv_blocks: Some((1 << 21) / 16 - 1),
        ..KvOptions::default()
    };
    assert!(kv_layout(&big, &at, &keys).is_ok());
    let over = KvOptions {
        kv_blocks: Some((1 << 21) / 16 + 64),
        ..KvOptions::default()
    };
    let m = kv_layout(&big, &over, &keys).unwrap_err().to_string();
    assert!(m.contains("--kv-blocks") && m.contains("1024 GiB"), "{m}");
    // The default sizing (every row of the widest key reaching the context)
    // is refused the same way.
    let wide = [Key::new(64, 1, 0)];
    let m = kv_layout(
        &big,
        &KvOptions {
            max_context: Some(1 << 21),
            ..KvOptions::default()
        },
        &wide,
    )
    .unwrap_err()
    .to_string();
    assert!(m.contains("1024 GiB"), "{m}");
}

#[test]
fn compiling_a_tiny_model_with_an_absurd_key_fails_fast_with_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::default()).unwrap();
    let opts = CompileOptions {
        keys: vec![Key::new(1, u32::MAX, 0)],
        ..CompileOptions::default()
    };
    let start = std::time::Instant::now();
    let e = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("--query"), "{e}");
    assert!(start.elapsed().as_secs() < 30);
    let opts = CompileOptions {
        keys: vec![Key::new(2, 1, 0)],
        ..CompileOptions::default()
    };
    compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap();
}

#[test]
fn a_plan_larger_than_device_memory_is_refused_at_compile_with_both_figures() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::default()).unwrap();
    let fits = compile_dir(dir.path(), &CompileOptions::default(), &mut |_, _| {}).unwrap();
    let need = fits.plan.device_memory().total();
    // Exactly enough compiles to the same plan.
    let opts = CompileOptions {
        device_memory: Some(need),
        ..CompileOptions::default()
    };
    let at = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap();
    assert_eq!(at.plan.device_memory(), fits.plan.device_memory());
    for budget in [need - 1, need / 3] {
        let opts = CompileOptions {
            device_memory: Some(budget),
            ..CompileOptions::default()
        };
        match compile_dir(dir.path(), &opts, &mut |_, _| {}) {
            Err(CompileError::Options(m)) => {
                assert!(
                    m.contains(&format!("needs {need} bytes"))
                        && m.contains(&format!("the {budget} bytes --device-memory"))
                        && m.contains(&format!("({} too many)", need - budget)),
                    "{m}"
                );
                assert!(m.contains("--kv-blocks"), "{m}");
            }
            other => panic!("budget {budget} of {need}: {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn device_memory_sizes_parse_in_decimal_and_binary_units() {
    assert_eq!(parse_size("141GiB"), Ok(141 << 30));
    assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
    assert_eq!(parse_size("512 mib"), Ok(512 << 20));
    assert_eq!(parse_size("1.5KiB"), Ok(1536));
    assert_eq!(parse_size("4096"), Ok(4096));
    for bad in ["", "GiB", "12 parsecs", "1.5", "-3GB", "99999999999TiB"] {
        let e = parse_size(bad).unwrap_err();
        assert!(e.contains(bad.trim()) || e.contains("2^64"), "{bad}: {e}");
    }
}
