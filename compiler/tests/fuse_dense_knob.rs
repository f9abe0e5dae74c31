//! `KILN_FUSE_DENSE` read by the default graph rule (`fuse-matmul-graph`)
//! on a GPU target: what a b8 key's dense matmuls fuse under each form of
//! the knob. The knob is process-wide, so this file holds one test and
//! sets it in turn (no other test of this binary can read it midway).

mod planner_support;

use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_compiler::passes::{run_pipeline_for, Pass};
use kiln_ir::plan::Target;
use kiln_ir::{Epilogue, Key, Op};
use planner_support::default_pipeline_with;

#[test]
fn the_dense_knob_fuses_eight_token_keys_and_bounds_their_norm_prologues_by_k() {
    let cuda = Target::Cuda { sm: 90 };
    let passes = default_pipeline_with(Pass::FuseMatMulGraph);
    // (knob, hidden, fused epilogues, fused prologues) for the b8 key.
    let cases: [(Option<&str>, u32, bool, bool); 6] = [
        (None, 1024, false, false),
        (Some("8"), 1024, true, true),
        (Some("8"), 2048, true, true),
        (Some("8:1024"), 1024, true, true),
        (Some("8:1024"), 2048, true, false),
        (Some("4"), 1024, false, false),
    ];
    for (knob, hidden, epilogues, prologues) in cases {
        match knob {
            Some(v) => std::env::set_var("KILN_FUSE_DENSE", v),
            None => std::env::remove_var("KILN_FUSE_DENSE"),
        }
        let spec = SynthSpec {
            hidden,
            intermediate: 64,
            ..SynthSpec::tiny(SynthFamily::Llama)
        };
        let key: Key = "b8q1s0".parse().unwrap();
        let g = spec.graph(key, &spec.kv_layout(16, key.batch * 4 + 1, 64), false);
        let mut m = spec.manifest();
        let (g, _, s) =
            run_pipeline_for(g, &mut m, &passes, true, &cuda).unwrap_or_else(|e| panic!("{e}"));
        let what = format!("KILN_FUSE_DENSE={knob:?} hidden {hidden}: {s:?}");
        let count = |f: &dyn Fn(&Op) -> bool| g.nodes.iter().filter(|n| f(&n.op)).count();
        let silu = count(&|o| {
            matches!(
                o,
                Op::FusedMatMul {
                    post: Epilogue::SiluMul,
                    ..
                }
            )
        });
        let residual = count(&|o| {
            matches!(
                o,
                Op::FusedMatMul {
                    post: Epilogue::Residual,
                    ..
                }
            )
        });
        let pre = count(&|o| matches!(o, Op::FusedMatMul { pre: Some(_), .. }));
        let layers = spec.layers as usize;
        assert_eq!(silu, if epilogues { layers } else { 0 }, "{what}");
        assert_eq!(residual > 0, epilogues, "{what}");
        assert_eq!(pre > 0, prologues, "{what}");
    }
    std::env::remove_var("KILN_FUSE_DENSE");
}
