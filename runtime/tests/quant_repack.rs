//! The GPU repack of quantized weights (`kiln_kernels::quant_gpu`) against
//! GGUF's own dequantizer (`kiln_compiler::gguf::dequant`): random blocks of
//! every GGUF type at awkward shapes, repacked, then decoded from the
//! repacked layout, equal the original blocks' decoding bit for bit (the
//! repacked layout is the one the CUDA kernels read; their GPU tests use the
//! same decoder as the reference). Lives here because the kernels crate
//! cannot depend on the compiler.

use kiln_compiler::gguf::dequant::{dequantize, random_blocks};
use kiln_compiler::gguf::types::GgmlType;
use kiln_kernels::quant_gpu::{dequantize_repacked, repack, repacked_bytes, QuantType};

fn ggml(q: QuantType) -> GgmlType {
    match q {
        QuantType::Q8_0 => GgmlType::Q8_0,
        QuantType::Q4_0 => GgmlType::Q4_0,
        QuantType::Q4_1 => GgmlType::Q4_1,
        QuantType::Q5_0 => GgmlType::Q5_0,
        QuantType::Q4K => GgmlType::Q4K,
        QuantType::Q5K => GgmlType::Q5K,
        QuantType::Q6K => GgmlType::Q6K,
        QuantType::Fp8E4M3 => unreachable!("FP8 is not a GGUF type"),
    }
}

const GGUF_TYPES: [QuantType; 7] = [
    QuantType::Q8_0,
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q4K,
    QuantType::Q5K,
    QuantType::Q6K,
];

#[test]
fn repacked_blocks_decode_bitwise_equal_to_gguf_dequantization_for_every_type() {
    let mut seed = 1;
    for q in GGUF_TYPES {
        let be = q.block_elems() as u64;
        // One block, a few, many; N not a multiple of the kernels' 16 rows.
        for (n, k) in [(1u64, be), (3, 2 * be), (17, 7 * be), (5, 4096)] {
            if k % be != 0 {
                continue;
            }
            seed += 1;
            let blocks = (n * k / be) as usize;
            let src = random_blocks(ggml(q), blocks, seed);
            let want = dequantize(ggml(q), &src, (n * k) as usize).unwrap();
            let rp = repack(q, &src, n, k).unwrap();
            assert_eq!(rp.len() as u64, repacked_bytes(q, n, k).unwrap());
            let got = dequantize_repacked(q, &rp, None, n, k).unwrap();
            assert_eq!(got.len(), want.len());
            let bad = got
                .iter()
                .zip(&want)
                .position(|(g, w)| g != w || g.is_nan() != w.is_nan());
            if let Some(i) = bad {
                panic!(
                    "{q:?} [{n}, {k}] element {i} (row {}, col {}): repacked {} vs gguf {}",
                    i as u64 / k,
                    i as u64 % k,
                    got[i],
                    want[i]
                );
            }
            // The data changes with the seed, so the check is not vacuous.
            assert!(want.iter().any(|v| *v != 0.0), "{q:?}: all zero");
        }
    }
}

#[test]
fn a_changed_source_byte_changes_the_repacked_decoding() {
    // Guards the comparison above against a repack that ignores its input.
    for q in GGUF_TYPES {
        let k = q.block_elems() as u64 * 2;
        let mut src = random_blocks(ggml(q), 2, 99);
        let before = dequantize_repacked(q, &repack(q, &src, 1, k).unwrap(), None, 1, k).unwrap();
        let last = src.len() - q.block_bytes() - 1; // a quant byte of block 0
        let at = if q == QuantType::Q6K { 5 } else { last };
        src[at] ^= 0x11;
        let after = dequantize_repacked(q, &repack(q, &src, 1, k).unwrap(), None, 1, k).unwrap();
        assert_ne!(before, after, "{q:?}");
        assert_eq!(
            after,
            dequantize(ggml(q), &src, k as usize).unwrap(),
            "{q:?}"
        );
    }
}
