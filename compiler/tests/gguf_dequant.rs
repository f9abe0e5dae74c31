//! Dequantization against hand-computed blocks, the quantizers' error
//! bounds on random data, and the type table.

use kiln_compiler::gguf::dequant::{self, DequantError};
use kiln_compiler::gguf::fixture::Rng;
use kiln_compiler::gguf::{GgmlType, GgufError, GgufFile, GgufWriter};

/// f16 bit patterns used below: 0.5, 0.25, -1.0, 1.0, -2.0, 65504.
const F16_HALF: [u8; 2] = 0x3800u16.to_le_bytes();
const F16_QUARTER: [u8; 2] = 0x3400u16.to_le_bytes();
const F16_MINUS_ONE: [u8; 2] = 0xbc00u16.to_le_bytes();

#[test]
fn f32_f16_and_bf16_decode_their_bit_patterns() {
    let f32s: Vec<u8> = [1.5f32, -0.0, 3.0e-38, -7.25]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(
        dequant::dequantize(GgmlType::F32, &f32s, 4).unwrap(),
        vec![1.5, -0.0, 3.0e-38, -7.25]
    );
    let f16s: Vec<u8> = [0x3c00u16, 0xc000, 0x7bff, 0x0001]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(
        dequant::dequantize(GgmlType::F16, &f16s, 4).unwrap(),
        vec![1.0, -2.0, 65504.0, 5.960_464_5e-8]
    );
    let bf16s: Vec<u8> = [0x3f80u16, 0xc040, 0x4049, 0x7f80]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(
        dequant::dequantize(GgmlType::BF16, &bf16s, 4).unwrap(),
        vec![1.0, -3.0, 3.140625, f32::INFINITY]
    );
}

#[test]
fn q8_0_block_is_scale_times_signed_bytes() {
    let mut block = F16_HALF.to_vec();
    let q: [i8; 32] = std::array::from_fn(|i| match i {
        0 => 127,
        1 => -127,
        2 => -128,
        3 => 0,
        _ => (i as i8) * 3 - 50,
    });
    block.extend(q.iter().map(|&v| v as u8));
    let x = dequant::dequantize(GgmlType::Q8_0, &block, 32).unwrap();
    assert_eq!(&x[..4], &[63.5, -63.5, -64.0, 0.0]);
    assert_eq!(x[4], (4.0 * 3.0 - 50.0) * 0.5); // -19
    assert_eq!(x[31], (31.0 * 3.0 - 50.0) * 0.5); // 21.5
}

#[test]
fn q4_0_low_nibbles_are_elements_0_to_15_and_high_nibbles_16_to_31() {
    let mut block = F16_QUARTER.to_vec();
    let mut qs = [0x88u8; 16]; // both nibbles 8: value 0
    qs[0] = 0x1f; // element 0: 15 -> +1.75, element 16: 1 -> -1.75
    qs[1] = 0x80; // element 1: 0 -> -2.0, element 17: 8 -> 0
    qs[15] = 0xe3; // element 15: 3 -> -1.25, element 31: 14 -> 1.5
    block.extend(qs);
    let x = dequant::dequantize(GgmlType::Q4_0, &block, 32).unwrap();
    let mut want = [0f32; 32];
    want[0] = 1.75;
    want[16] = -1.75;
    want[1] = -2.0;
    want[15] = -1.25;
    want[31] = 1.5;
    assert_eq!(x, want);
}

#[test]
fn q4_1_block_is_nibble_times_scale_plus_min() {
    let mut block = F16_HALF.to_vec();
    block.extend(F16_MINUS_ONE);
    let mut qs = [0x22u8; 16]; // both nibbles 2: 2*0.5 - 1 = 0
    qs[0] = 0xa3; // element 0: 3 -> 0.5, element 16: 10 -> 4.0
    qs[7] = 0x0f; // element 7: 15 -> 6.5, element 23: 0 -> -1.0
    block.extend(qs);
    let x = dequant::dequantize(GgmlType::Q4_1, &block, 32).unwrap();
    let mut want = [0f32; 32];
    want[0] = 0.5;
    want[16] = 4.0;
    want[7] = 6.5;
    want[23] = -1.0;
    assert_eq!(x, want);
}

#[test]
fn consecutive_blocks_decode_in_order() {
    // Two Q8_0 blocks with different scales and the same bytes.
    let q: Vec<u8> = (0..32).map(|i| (i as i8 - 16) as u8).collect();
    let mut data = F16_HALF.to_vec();
    data.extend(&q);
    data.extend(F16_QUARTER);
    data.extend(&q);
    let x = dequant::dequantize(GgmlType::Q8_0, &data, 64).unwrap();
    for i in 0..32 {
        assert_eq!(x[i], (i as f32 - 16.0) * 0.5);
        assert_eq!(x[32 + i], (i as f32 - 16.0) * 0.25);
    }
}

fn max_err(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn quantizers_round_trip_random_data_within_their_step_bounds() {
    let mut rng = Rng::new(11);
    for trial in 0..20 {
        let scale = 0.01 + trial as f32;
        let x = rng.vec(32 * 16, scale);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
            let bytes = dequant::quantize(ty, &x).unwrap();
            assert_eq!(bytes.len(), dequant::byte_len(ty, x.len()).unwrap());
            let y = dequant::dequantize(ty, &bytes, x.len()).unwrap();
            for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
                let lo = bx.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = bx.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let amax = lo.abs().max(hi.abs());
                // Half a quantization step, plus the f16 rounding of the
                // stored scale (and min) times the largest code. Q4_0 maps
                // the largest magnitude to -8, so a value of the opposite
                // sign near +amax clamps at +7: up to a whole step there.
                let (step, steps) = match ty {
                    GgmlType::Q8_0 => (amax / 127.0, 0.5),
                    GgmlType::Q4_0 => (amax / 8.0, 1.0),
                    _ => ((hi - lo) / 15.0, 0.5),
                };
                let bound = steps * step + 16.0 * step * 2f32.powi(-10) + amax * 2f32.powi(-10);
                let err = max_err(bx, by);
                assert!(err <= bound, "{ty} scale {scale}: error {err} > {bound}");
            }
        }
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            let y = dequant::dequantize(ty, &dequant::quantize(ty, &x).unwrap(), x.len()).unwrap();
            let rel = match ty {
                GgmlType::F32 => 0.0,
                GgmlType::F16 => 2f32.powi(-11),
                _ => 2f32.powi(-8),
            };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= a.abs() * rel + 1e-7, "{ty}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn types_without_a_dequantizer_are_errors_naming_the_type() {
    for ty in [
        GgmlType::Q8K,
        GgmlType::Q8_1,
        GgmlType::Iq4Xs,
        GgmlType::Iq2Xxs,
        GgmlType::Tq1_0,
        GgmlType::I32,
    ] {
        let n = ty.block_size() as usize;
        let data = vec![0u8; ty.block_bytes() as usize];
        let err = dequant::dequantize(ty, &data, n).unwrap_err();
        assert_eq!(err, DequantError::Unsupported(ty));
        assert!(err.to_string().contains(ty.name()), "{err}");
    }
    // Through a file: the error names the tensor and the type.
    let mut w = GgufWriter::new();
    w.add_raw_tensor(
        "blk.0.ffn_up.weight",
        &[256, 2],
        GgmlType::Iq4Xs,
        vec![7; 272],
    )
    .unwrap();
    let g = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let err = g.dequantize("blk.0.ffn_up.weight").unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::UnsupportedDequant {
                ty: GgmlType::Iq4Xs,
                ..
            }
        ),
        "{err}"
    );
    // It names the tensor, the type, what is supported and what is not.
    let msg = err.to_string();
    for needle in [
        "blk.0.ffn_up.weight",
        "IQ4_XS",
        "Q4_K",
        "Q6_K",
        "Q5_0",
        "not supported: I-quants",
    ] {
        assert!(msg.contains(needle), "{needle} missing from: {msg}");
    }
}

#[test]
fn wrong_data_lengths_are_errors_not_panics() {
    let err = dequant::dequantize(GgmlType::Q4_1, &[0u8; 19], 32).unwrap_err();
    assert!(
        matches!(
            err,
            DequantError::WrongLength {
                expected: 20,
                got: 19,
                ..
            }
        ),
        "{err}"
    );
    let err = dequant::dequantize(GgmlType::Q8_0, &[0u8; 34], 31).unwrap_err();
    assert!(matches!(err, DequantError::NotWholeBlocks { .. }), "{err}");
    let err = dequant::quantize(GgmlType::Q4_0, &[1.0; 33]).unwrap_err();
    assert!(matches!(err, DequantError::NotWholeBlocks { .. }), "{err}");
}

#[test]
fn ggml_type_ids_round_trip_and_block_sizes_match_ggml() {
    let mut ids = std::collections::HashSet::new();
    for ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        assert!(ids.insert(ty.id()), "duplicate id {}", ty.id());
    }
    for retired in [4u32, 5, 31, 32, 33, 36, 37, 38, 1000] {
        assert_eq!(GgmlType::from_id(retired), None, "id {retired}");
    }
    // Spot checks against ggml's block structs.
    let table = [
        (GgmlType::Q4_0, 2, 32, 18),
        (GgmlType::Q4_1, 3, 32, 20),
        (GgmlType::Q8_0, 8, 32, 34),
        (GgmlType::Q4K, 12, 256, 144),
        (GgmlType::Q6K, 14, 256, 210),
        (GgmlType::Iq4Xs, 23, 256, 136),
        (GgmlType::BF16, 30, 1, 2),
    ];
    for (ty, id, block, bytes) in table {
        assert_eq!(
            (ty.id(), ty.block_size(), ty.block_bytes()),
            (id, block, bytes),
            "{ty}"
        );
    }
}
