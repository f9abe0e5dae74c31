//! Q5_0/Q5_1 and the K-quants (Q2_K..Q6_K): kiln's dequantizer against a
//! per-element restatement of ggml's block formats, written here from the
//! format description (not from kiln's loop structure), on random blocks;
//! against the `gguf` Python package where it is installed; and damaged
//! blocks as clear errors.

use kiln_compiler::gguf::dequant::{self, DequantError};
use kiln_compiler::gguf::fixture::python_dequantize;
use kiln_compiler::gguf::{GgmlType, GgufError, GgufFile, GgufWriter};

const TYPES: [GgmlType; 7] = [
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn h(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn bit(bytes: &[u8], i: usize) -> u32 {
    u32::from((bytes[i / 8] >> (i % 8)) & 1)
}

/// The 6-bit scale `i` (0..16) of Q3_K's 12 scale bytes: low four bits in
/// the nibbles of bytes 0..8 (low nibbles first), high two bits in bytes
/// 8..12, two bits per scale, four scales per byte.
fn q3k_scale(s: &[u8], i: usize) -> i32 {
    let low = if i < 8 { s[i] & 15 } else { s[i - 8] >> 4 };
    let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

/// Scale and min `j` (0..8) of Q4_K/Q5_K's 12 scale bytes: bytes 0..4 hold
/// scales 0..4 in their low six bits, bytes 4..8 the mins 0..4; scales and
/// mins 4..8 keep their low nibbles in bytes 8..12 (scale low, min high)
/// and their top two bits in the top bits of bytes 0..4 (scales) and 4..8
/// (mins).
fn k4_scale_min(s: &[u8], j: usize) -> (f32, f32) {
    if j < 4 {
        (f32::from(s[j] & 63), f32::from(s[j + 4] & 63))
    } else {
        let sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        let m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (f32::from(sc), f32::from(m))
    }
}

/// Element `e` of one block, straight from the format description.
fn reference(ty: GgmlType, b: &[u8], e: usize) -> f32 {
    match ty {
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            // Nibble j holds element j (low) and j+16 (high); bit e of the
            // u32 qh is element e's fifth bit.
            let (qh, qs) = if ty == GgmlType::Q5_0 {
                (&b[2..6], &b[6..22])
            } else {
                (&b[4..8], &b[8..24])
            };
            let nib = if e < 16 { qs[e] & 15 } else { qs[e - 16] >> 4 };
            let q = u32::from(nib) | (bit(qh, e) << 4);
            if ty == GgmlType::Q5_0 {
                (q as i32 - 16) as f32 * h(b, 0)
            } else {
                q as f32 * h(b, 0) + h(b, 2)
            }
        }
        GgmlType::Q2K => {
            // 2-bit value: byte 32·(e/128) + e%32, bit pair (e%128)/32;
            // scale byte e/16: low nibble scale, high nibble min.
            let q = (b[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            let sc = b[e / 16];
            h(b, 80) * f32::from(sc & 15) * f32::from(q) - h(b, 82) * f32::from(sc >> 4)
        }
        GgmlType::Q3K => {
            // Low two bits as in Q2_K; the third bit is bit e/32 of hmask
            // byte e%32, and a clear bit subtracts 4.
            let low = (b[32 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            let high_set = (b[e % 32] >> (e / 32)) & 1 == 1;
            let q = i32::from(low) - if high_set { 0 } else { 4 };
            h(b, 108) * q3k_scale(&b[96..108], e / 16) as f32 * q as f32
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            // Sub-block s = e/32 of eight; 64-element chunks share 32 bytes
            // of nibbles, the even sub-block in the low nibbles. Q5_K's
            // fifth bit is bit s of qh byte e%32.
            let five = ty == GgmlType::Q5K;
            let qs = if five { &b[48..176] } else { &b[16..144] };
            let s = e / 32;
            let byte = qs[32 * (e / 64) + e % 32];
            let mut q = if s.is_multiple_of(2) {
                byte & 15
            } else {
                byte >> 4
            };
            if five && (b[16 + e % 32] >> s) & 1 == 1 {
                q += 16;
            }
            let (sc, m) = k4_scale_min(&b[4..16], s);
            h(b, 0) * sc * f32::from(q) - h(b, 2) * m
        }
        GgmlType::Q6K => {
            // Half n = e/128; within it, quarter k = r/32 of r = e%128 and
            // l = r%32: low nibble from ql byte 64n + l + 32·(k%2) (low
            // nibble for k < 2), high two bits from qh byte 32n + l, bits
            // 2k..2k+2; signed scale byte 8n + r/16; value offset 32.
            let (n, r) = (e / 128, e % 128);
            let (k, l) = (r / 32, r % 32);
            let lq = b[64 * n + l + 32 * (k % 2)];
            let low = if k < 2 { lq & 15 } else { lq >> 4 };
            let high = (b[128 + 32 * n + l] >> (2 * k)) & 3;
            let q = i32::from(low | (high << 4)) - 32;
            let sc = f32::from(b[192 + 8 * n + r / 16] as i8);
            h(b, 208) * sc * q as f32
        }
        _ => unreachable!("reference for {ty}"),
    }
}

fn close(a: f32, b: f32, scale: f32) -> bool {
    (a - b).abs() <= 1e-6 * scale.max(1e-30)
}

#[test]
fn every_new_block_type_matches_the_per_element_reference_on_random_blocks() {
    for ty in TYPES {
        for seed in 0..8u64 {
            let blocks = 3;
            let data = dequant::random_blocks(ty, blocks, seed * 31 + ty.id() as u64);
            let n = blocks * ty.block_size() as usize;
            let got = dequant::dequantize(ty, &data, n).unwrap();
            let bb = ty.block_bytes() as usize;
            let bs = ty.block_size() as usize;
            let want: Vec<f32> = (0..n)
                .map(|i| reference(ty, &data[i / bs * bb..(i / bs + 1) * bb], i % bs))
                .collect();
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert!(scale > 0.0, "{ty}: random blocks decode to all zeros");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    close(*g, *w, scale),
                    "{ty} seed {seed} element {i}: kiln {g}, reference {w}"
                );
            }
        }
    }
}

#[test]
fn q4_k_decodes_a_hand_built_block() {
    // d = 1, dmin = 0.5; sub-block 0 has scale 2 and min 3, sub-block 1
    // scale 5 and min 1 (both in the j < 4 layout), sub-block 5 (j >= 4)
    // scale 33 (0b10_0001) and min 18 (0b01_0010); nibbles all 7 (low) / 9.
    let mut b = vec![0u8; 144];
    b[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
    b[2..4].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
    let s = &mut b[4..16];
    s[0] = 2;
    s[4] = 3;
    s[1] = 5;
    s[5] = 1;
    s[9] = 0x21 & 15 | (0x12 & 15) << 4; // j = 5: low nibbles in byte j+4
    s[1] |= (0x21 >> 4) << 6; // top bits of scale 5 in byte j-4
    s[5] |= (0x12 >> 4) << 6; // top bits of min 5 in byte j
    b[16..144].fill(0x97);
    let y = dequant::dequantize(GgmlType::Q4K, &b, 256).unwrap();
    assert_eq!(y[0], 2.0 * 7.0 - 0.5 * 3.0);
    assert_eq!(y[32], 5.0 * 9.0 - 0.5 * 1.0);
    assert_eq!(y[160], 33.0 * 9.0 - 0.5 * 18.0);
}

#[test]
fn damaged_k_quant_data_is_an_error_naming_type_and_sizes() {
    for ty in TYPES {
        let bs = ty.block_size() as usize;
        let bb = ty.block_bytes() as usize;
        let data = dequant::random_blocks(ty, 2, 1);
        // Truncated by one byte, and one byte too long.
        for len in [2 * bb - 1, 2 * bb + 1] {
            let mut d = data.clone();
            d.resize(len, 0);
            let err = dequant::dequantize(ty, &d, 2 * bs).unwrap_err();
            assert_eq!(
                err,
                DequantError::WrongLength {
                    ty,
                    n: 2 * bs,
                    expected: 2 * bb,
                    got: len
                }
            );
            assert!(err.to_string().contains(ty.name()), "{err}");
        }
        // An element count that is not whole blocks.
        let err = dequant::dequantize(ty, &data, 2 * bs - 1).unwrap_err();
        assert!(matches!(err, DequantError::NotWholeBlocks { .. }), "{err}");
    }
}

#[test]
fn damaged_k_quant_tensors_in_a_file_are_clear_errors() {
    let mut bytes = {
        let mut w = GgufWriter::new();
        w.add_raw_tensor(
            "blk.0.ffn_down.weight",
            &[256, 4],
            GgmlType::Q6K,
            dequant::random_blocks(GgmlType::Q6K, 4, 9),
        )
        .unwrap();
        w.to_bytes().unwrap()
    };
    // Truncated download: the last block is cut short.
    bytes.truncate(bytes.len() - 100);
    let err = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "{err}");
    assert!(err.to_string().contains("blk.0.ffn_down.weight"), "{err}");

    // Rows of 128 elements cannot hold 256-element Q4_K blocks, even when
    // the byte count adds up (two half rows = one block): the reader
    // refuses the file before anyone decodes it.
    let mut bad = GgufWriter::new();
    bad.add_raw_tensor(
        "blk.0.attn_q.weight",
        &[128, 2],
        GgmlType::Q4K,
        vec![0; 144],
    )
    .unwrap();
    let image = bad.to_bytes().unwrap();
    let err = GgufFile::from_bytes(image).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::NotBlockAligned {
                ty: GgmlType::Q4K,
                ne0: 128,
                block: 256,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn every_supported_quantized_type_matches_the_gguf_python_package() {
    let mut w = GgufWriter::new();
    w.add_meta(
        "general.architecture",
        kiln_compiler::gguf::MetaValue::String("parity".into()),
    );
    let mut types = TYPES.to_vec();
    types.extend([
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::F16,
    ]);
    for (i, ty) in types.iter().enumerate() {
        let rows = 3u64;
        let ne0 = 512u64;
        let blocks = (rows * ne0 / ty.block_size()) as usize;
        w.add_raw_tensor(
            &format!("t{i}.{}", ty.name()),
            &[ne0, rows],
            *ty,
            dequant::random_blocks(*ty, blocks, 77 + i as u64),
        )
        .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("parity.gguf");
    std::fs::write(&path, w.to_bytes().unwrap()).unwrap();
    let Some(py) = python_dequantize(&path, &[]) else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(py.len(), types.len());
    for t in g.tensors() {
        let ours = g.dequantize(&t.name).unwrap();
        let theirs = &py[&t.name];
        assert_eq!(ours.len(), theirs.len(), "{}", t.name);
        let scale = theirs.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            assert!(
                close(*a, *b, scale),
                "{} element {i}: kiln {a}, gguf {b}",
                t.name
            );
        }
    }
}
