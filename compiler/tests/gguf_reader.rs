//! The GGUF reader on files the tests write: every metadata type, tensor
//! tables, alignment, and every kind of damage a file can carry.

use kiln_compiler::gguf::fixture::Rng;
use kiln_compiler::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaValue, ValueType};

fn all_value_types() -> Vec<(&'static str, MetaValue)> {
    vec![
        ("t.u8", MetaValue::U8(200)),
        ("t.i8", MetaValue::I8(-100)),
        ("t.u16", MetaValue::U16(60000)),
        ("t.i16", MetaValue::I16(-30000)),
        ("t.u32", MetaValue::U32(4_000_000_000)),
        ("t.i32", MetaValue::I32(-2_000_000_000)),
        ("t.f32", MetaValue::F32(-1.5e-3)),
        ("t.bool", MetaValue::Bool(true)),
        ("t.string", MetaValue::String("héllo ✓ 世界".into())),
        ("t.u64", MetaValue::U64(u64::MAX - 7)),
        ("t.i64", MetaValue::I64(i64::MIN + 3)),
        ("t.f64", MetaValue::F64(std::f64::consts::PI)),
        (
            "t.array_empty",
            MetaValue::Array {
                elem: ValueType::F32,
                items: vec![],
            },
        ),
        (
            "t.array_str",
            MetaValue::Array {
                elem: ValueType::String,
                items: vec![MetaValue::String("a".into()), MetaValue::String("".into())],
            },
        ),
        (
            "t.array_nested",
            MetaValue::Array {
                elem: ValueType::Array,
                items: vec![
                    MetaValue::Array {
                        elem: ValueType::I16,
                        items: vec![MetaValue::I16(-1), MetaValue::I16(2)],
                    },
                    MetaValue::Array {
                        elem: ValueType::Bool,
                        items: vec![MetaValue::Bool(false)],
                    },
                ],
            },
        ),
    ]
}

/// A small valid file: all metadata types and two tensors.
fn sample(alignment: Option<u32>) -> (GgufWriter, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(7);
    let a = rng.vec(3 * 64, 2.0);
    let b = rng.vec(5, 1.0);
    let mut w = GgufWriter::new();
    for (k, v) in all_value_types() {
        w.add_meta(k, v);
    }
    if let Some(al) = alignment {
        w.add_u32("general.alignment", al);
    }
    w.add_tensor("a.weight", &[3, 64], GgmlType::F32, &a)
        .unwrap();
    w.add_tensor("b.bias", &[5], GgmlType::F32, &b).unwrap();
    (w, a, b)
}

fn bytes_of(w: &GgufWriter) -> Vec<u8> {
    w.to_bytes().unwrap()
}

/// A header whose only key is `general.alignment` holding `value`, written
/// by hand because the writer refuses invalid alignments.
fn header_with_alignment(value: &MetaValue) -> Vec<u8> {
    let key = "general.alignment";
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(value.value_type().id().to_le_bytes());
    match value {
        MetaValue::U32(v) => b.extend(v.to_le_bytes()),
        MetaValue::String(s) => {
            b.extend((s.len() as u64).to_le_bytes());
            b.extend(s.as_bytes());
        }
        other => panic!("unused in this test: {other:?}"),
    }
    b
}

#[test]
fn every_metadata_value_type_reads_back_as_written() {
    let (w, _, _) = sample(None);
    let g = GgufFile::from_bytes(bytes_of(&w)).unwrap();
    assert_eq!(g.version(), 3);
    for (k, v) in all_value_types() {
        assert_eq!(g.get(k), Some(&v), "key {k}");
    }
    assert_eq!(g.metadata().len(), all_value_types().len());
}

#[test]
fn tensor_table_reports_ggml_dims_and_reversed_pytorch_shape() {
    let (w, a, b) = sample(None);
    let g = GgufFile::from_bytes(bytes_of(&w)).unwrap();
    let t = g.tensor("a.weight").unwrap();
    assert_eq!(t.dims, vec![64, 3]);
    assert_eq!(t.shape(), vec![3, 64]);
    assert_eq!(t.n_elements, 192);
    assert_eq!(t.n_bytes, 192 * 4);
    assert_eq!(g.dequantize("a.weight").unwrap(), a);
    assert_eq!(g.dequantize("b.bias").unwrap(), b);
    assert_eq!(g.tensors().len(), 2);
    let err = g.dequantize("nope").unwrap_err();
    assert!(matches!(err, GgufError::NoSuchTensor { .. }), "{err}");
}

#[test]
fn default_alignment_is_32_and_general_alignment_overrides_it() {
    for (al, expect) in [
        (None, 32u64),
        (Some(64), 64),
        (Some(256), 256),
        (Some(1), 1),
    ] {
        let (w, a, _) = sample(al);
        let g = GgufFile::from_bytes(bytes_of(&w)).unwrap();
        assert_eq!(g.alignment(), expect);
        assert_eq!(g.data_start() % expect, 0);
        for t in g.tensors() {
            assert_eq!(t.offset % expect, 0, "{} at {}", t.name, t.offset);
        }
        assert_eq!(g.dequantize("a.weight").unwrap(), a);
    }
}

#[test]
fn version_2_files_are_accepted() {
    let (mut w, a, _) = sample(None);
    w.set_version(2);
    let g = GgufFile::from_bytes(bytes_of(&w)).unwrap();
    assert_eq!(g.version(), 2);
    assert_eq!(g.dequantize("a.weight").unwrap(), a);
}

#[test]
fn other_versions_are_rejected_naming_the_version() {
    for v in [0u32, 1, 4, 0x0300_0000] {
        let (mut w, _, _) = sample(None);
        w.set_version(v);
        let err = GgufFile::from_bytes(bytes_of(&w)).unwrap_err();
        assert!(
            matches!(err, GgufError::UnsupportedVersion { version } if version == v),
            "{err}"
        );
        assert!(err.to_string().contains(&format!("version {v}")), "{err}");
    }
}

#[test]
fn bad_magic_is_rejected_with_the_bytes_found() {
    let mut b = bytes_of(&sample(None).0);
    b[..4].copy_from_slice(&[0x7b, 0x22, 0x5f, 0x5f]); // `{"__`, a safetensors header
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(err, GgufError::BadMagic { .. }), "{err}");
    assert!(err.to_string().contains("7b"), "{err}");
}

#[test]
fn every_truncation_of_a_valid_file_is_an_error_not_a_panic() {
    let full = bytes_of(&sample(None).0);
    for len in 0..full.len() {
        let err = GgufFile::from_bytes(full[..len].to_vec())
            .expect_err(&format!("prefix of {len} bytes parsed"));
        assert!(
            matches!(
                err,
                GgufError::Truncated { .. }
                    | GgufError::ImpossibleCount { .. }
                    | GgufError::TensorOutOfBounds { .. }
            ),
            "prefix {len}: {err}"
        );
    }
    GgufFile::from_bytes(full).unwrap();
}

#[test]
fn a_file_cut_inside_the_tensor_data_names_the_tensor() {
    let full = bytes_of(&sample(None).0);
    let g = GgufFile::from_bytes(full.clone()).unwrap();
    let t = g.tensor("b.bias").unwrap();
    let cut = (g.data_start() + t.offset + 3) as usize;
    let err = GgufFile::from_bytes(full[..cut].to_vec()).unwrap_err();
    match &err {
        GgufError::TensorOutOfBounds { name, .. } => assert_eq!(name, "b.bias"),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("truncated"), "{err}");
}

#[test]
fn tensor_data_beyond_the_end_of_the_file_is_rejected() {
    let mut w = GgufWriter::new();
    w.add_tensor("x", &[32], GgmlType::F32, &Rng::new(1).vec(32, 1.0))
        .unwrap();
    // Tensor record of "x": name len(8) "x"(1) n_dims(4) dim(8) type(4) offset(8).
    let offset_at = 24 + 8 + 1 + 4 + 8 + 4;
    for bad in [1u64 << 20, u64::MAX - 31] {
        let mut b = bytes_of(&w);
        b[offset_at..offset_at + 8].copy_from_slice(&bad.to_le_bytes());
        let err = GgufFile::from_bytes(b).unwrap_err();
        assert!(
            matches!(err, GgufError::TensorOutOfBounds { start, .. } if start == bad),
            "{err}"
        );
    }
    // A dimension larger than the data present.
    let mut b = bytes_of(&w);
    let dim_at = 24 + 8 + 1 + 4;
    b[dim_at..dim_at + 8].copy_from_slice(&64u64.to_le_bytes());
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::TensorOutOfBounds {
                end: 256,
                available: 128,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn absurd_tensor_and_metadata_counts_fail_before_allocating() {
    let base = bytes_of(&sample(None).0);
    // Tensor count at byte 8, metadata count at byte 16.
    for (at, what) in [(8usize, "tensor count"), (16, "metadata")] {
        for count in [u64::MAX, 1 << 60, 1 << 40] {
            let mut b = base.clone();
            b[at..at + 8].copy_from_slice(&count.to_le_bytes());
            let err = GgufFile::from_bytes(b).unwrap_err();
            assert!(
                matches!(err, GgufError::ImpossibleCount { count: c, .. } if c == count),
                "{what} {count}: {err}"
            );
            assert!(err.to_string().contains(what), "{err}");
        }
    }
}

#[test]
fn absurd_string_length_fails_before_allocating() {
    let mut b = bytes_of(&sample(None).0);
    // The first key's length prefix follows the 24-byte header.
    for len in [u64::MAX, 1 << 40] {
        b[24..32].copy_from_slice(&len.to_le_bytes());
        let err = GgufFile::from_bytes(b.clone()).unwrap_err();
        assert!(
            matches!(err, GgufError::ImpossibleCount { count, .. } if count == len),
            "{err}"
        );
    }
}

#[test]
fn absurd_array_length_fails_before_allocating() {
    let mut w = GgufWriter::new();
    w.add_meta(
        "big",
        MetaValue::Array {
            elem: ValueType::U64,
            items: vec![MetaValue::U64(1); 4],
        },
    );
    let mut b = bytes_of(&w);
    // header 24, key len 8 + "big" 3, value type 4, elem type 4, then the count.
    let at = 24 + 8 + 3 + 4 + 4;
    assert_eq!(u64::from_le_bytes(b[at..at + 8].try_into().unwrap()), 4);
    // 100 u64 items need 800 bytes; only the 32 item bytes and the header
    // padding follow.
    for count in [100u64, 1 << 40, u64::MAX] {
        b[at..at + 8].copy_from_slice(&count.to_le_bytes());
        let err = GgufFile::from_bytes(b.clone()).unwrap_err();
        assert!(matches!(err, GgufError::ImpossibleCount { .. }), "{err}");
        assert!(err.to_string().contains("big"), "{err}");
    }
}

#[test]
fn arrays_nested_deeper_than_the_limit_are_rejected() {
    let mut v = MetaValue::Array {
        elem: ValueType::U8,
        items: vec![],
    };
    for _ in 0..20 {
        v = MetaValue::Array {
            elem: ValueType::Array,
            items: vec![v],
        };
    }
    let mut w = GgufWriter::new();
    w.add_meta("deep", v);
    let err = GgufFile::from_bytes(bytes_of(&w)).unwrap_err();
    assert!(matches!(err, GgufError::NestingTooDeep { .. }), "{err}");
}

#[test]
fn unknown_value_and_tensor_type_ids_are_named() {
    let mut w = GgufWriter::new();
    w.add_u32("k", 5);
    let mut b = bytes_of(&w);
    let at = 24 + 8 + 1; // the value type of "k"
    b[at..at + 4].copy_from_slice(&13u32.to_le_bytes());
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(err, GgufError::UnknownValueType { type_id: 13, .. }),
        "{err}"
    );

    let mut w = GgufWriter::new();
    w.add_tensor("x", &[32], GgmlType::F32, &Rng::new(2).vec(32, 1.0))
        .unwrap();
    let mut b = bytes_of(&w);
    let at = 24 + 8 + 1 + 4 + 8; // the type of "x"
    b[at..at + 4].copy_from_slice(&4u32.to_le_bytes()); // retired Q4_2
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(err, GgufError::UnknownTensorType { type_id: 4, .. }),
        "{err}"
    );
}

#[test]
fn more_than_four_dims_is_rejected() {
    let mut w = GgufWriter::new();
    w.add_raw_tensor("x", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0, 0, 128, 63])
        .unwrap();
    let err = GgufFile::from_bytes(bytes_of(&w)).unwrap_err();
    assert!(
        matches!(err, GgufError::TooManyDims { n_dims: 5, .. }),
        "{err}"
    );
}

#[test]
fn element_count_overflow_is_rejected() {
    let mut w = GgufWriter::new();
    w.add_raw_tensor("x", &[1, 1], GgmlType::F32, vec![0; 4])
        .unwrap();
    let mut b = bytes_of(&w);
    let at = 24 + 8 + 1 + 4; // the two dims of "x"
    b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    b[at + 8..at + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(err, GgufError::SizeOverflow { .. }), "{err}");
}

#[test]
fn a_quantized_row_that_is_not_whole_blocks_is_rejected() {
    let mut w = GgufWriter::new();
    w.add_tensor("x", &[2, 32], GgmlType::Q8_0, &Rng::new(3).vec(64, 1.0))
        .unwrap();
    let mut b = bytes_of(&w);
    let at = 24 + 8 + 1 + 4; // ne0 of "x"
    b[at..at + 8].copy_from_slice(&48u64.to_le_bytes());
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::NotBlockAligned {
                ne0: 48,
                block: 32,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn misaligned_tensor_offsets_are_rejected() {
    let mut w = GgufWriter::new();
    w.add_tensor("x", &[8], GgmlType::F32, &Rng::new(4).vec(8, 1.0))
        .unwrap();
    w.add_tensor("y", &[8], GgmlType::F32, &Rng::new(5).vec(8, 1.0))
        .unwrap();
    let mut b = bytes_of(&w);
    let g = GgufFile::from_bytes(b.clone()).unwrap();
    assert_eq!(g.tensor("y").unwrap().offset, 32);
    // y's offset field: after x's record (8+1+4+8+4+8 = 33) and y's name,
    // dims and type (8+1+4+8+4).
    let at = 24 + 33 + 8 + 1 + 4 + 8 + 4;
    b[at..at + 8].copy_from_slice(&36u64.to_le_bytes());
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::MisalignedTensor {
                offset: 36,
                alignment: 32,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn alignment_that_is_zero_not_a_power_of_two_or_not_u32_is_rejected() {
    for bad in [
        MetaValue::U32(0),
        MetaValue::U32(48),
        MetaValue::String("32".into()),
    ] {
        let err = GgufFile::from_bytes(header_with_alignment(&bad)).unwrap_err();
        assert!(
            matches!(err, GgufError::BadAlignment { .. }),
            "{bad:?}: {err}"
        );
    }
    let g = GgufFile::from_bytes(header_with_alignment(&MetaValue::U32(16))).unwrap();
    assert_eq!(g.alignment(), 16);
    // The writer refuses to produce such a file in the first place.
    let mut w = GgufWriter::new();
    w.add_u32("general.alignment", 48);
    assert!(matches!(w.to_bytes(), Err(GgufError::Write { .. })));
}

#[test]
fn duplicate_keys_and_tensor_names_are_rejected() {
    let mut w = GgufWriter::new();
    w.add_u32("same", 1).add_u32("same", 2);
    let err = GgufFile::from_bytes(bytes_of(&w)).unwrap_err();
    assert!(matches!(err, GgufError::DuplicateKey { .. }), "{err}");

    // The writer refuses duplicate tensors, so rename one in the bytes.
    let mut w = GgufWriter::new();
    w.add_tensor("xa", &[8], GgmlType::F32, &Rng::new(6).vec(8, 1.0))
        .unwrap();
    w.add_tensor("xb", &[8], GgmlType::F32, &Rng::new(7).vec(8, 1.0))
        .unwrap();
    let mut b = bytes_of(&w);
    let pos = b.windows(2).position(|s| s == b"xb").unwrap();
    b[pos + 1] = b'a';
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(err, GgufError::DuplicateTensor { .. }), "{err}");
}

#[test]
fn invalid_utf8_in_a_key_is_an_error() {
    let mut w = GgufWriter::new();
    w.add_u32("kk", 1);
    let mut b = bytes_of(&w);
    b[32] = 0xff;
    let err = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }), "{err}");
}

#[test]
fn typed_getters_name_the_key_and_both_types() {
    let (w, _, _) = sample(None);
    let g = GgufFile::from_bytes(bytes_of(&w)).unwrap();
    assert_eq!(g.require_u64("t.u32", "test").unwrap(), 4_000_000_000);
    let err = g.get_u64("t.i8").unwrap_err();
    assert!(err.to_string().contains("t.i8"), "{err}");
    let err = g.require_str("t.u32", "test").unwrap_err();
    assert!(err.to_string().contains("uint32"), "{err}");
    let err = g
        .require_u64("absent.key", "is needed by this test")
        .unwrap_err();
    assert!(err.to_string().contains("absent.key"), "{err}");
    assert!(err.to_string().contains("is needed by this test"), "{err}");
    let err = g
        .require_array("t.array_str", ValueType::I32, "test")
        .unwrap_err();
    assert!(err.to_string().contains("array of 2 string"), "{err}");
}

#[test]
fn random_byte_corruption_never_panics() {
    let full = bytes_of(&sample(Some(64)).0);
    let mut rng = Rng::new(99);
    let mut errors = 0;
    for _ in 0..3000 {
        let mut b = full.clone();
        for _ in 0..1 + rng.next_u64() % 4 {
            let at = (rng.next_u64() % b.len() as u64) as usize;
            b[at] = rng.next_u64() as u8;
        }
        match GgufFile::from_bytes(b) {
            Ok(g) => {
                // Whatever parsed must be readable.
                for t in g.tensors() {
                    let _ = g.dequantize(&t.name);
                }
            }
            Err(_) => errors += 1,
        }
    }
    assert!(errors > 0, "corruption was never detected");
}

#[test]
fn files_open_from_disk_through_a_memory_map() {
    let (w, a, _) = sample(None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    w.write(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.path(), Some(path.as_path()));
    assert_eq!(g.dequantize("a.weight").unwrap(), a);

    std::fs::write(&path, b"").unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, GgufError::Truncated { .. }), "{err}");

    let err = GgufFile::open(&dir.path().join("missing.gguf")).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }), "{err}");
    assert!(err.to_string().contains("missing.gguf"), "{err}");
}
