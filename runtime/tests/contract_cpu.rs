//! The backend contract's shared bodies (`contract/mod.rs`) on the CPU
//! backend.

#[macro_use]
mod contract;

use contract::{f32_operand, Gemm, Target};
use kiln_ir::Op;
use kiln_runtime::backend::{DevPtr, Launch, LaunchBody};
use kiln_runtime::cpu::CpuStats;
use kiln_runtime::CpuBackend;

struct Cpu;

impl Target for Cpu {
    type B = CpuBackend;
    fn open(&self) -> CpuBackend {
        CpuBackend::new()
    }
    fn add(&self, a: DevPtr, b: DevPtr, c: DevPtr, n: u32) -> Launch {
        Launch {
            kernel: "add_f32".into(),
            op: Op::Add,
            args: vec![f32_operand(a, vec![n]), f32_operand(b, vec![n])],
            results: vec![f32_operand(c, vec![n])],
            workspace: None,
            const_args: 0,
            body: LaunchBody::Reference,
        }
    }
    fn gemm(&self, g: Gemm, ws: Option<(DevPtr, u64)>) -> Launch {
        g.launch(ws, LaunchBody::Reference)
    }
    fn replays(&self, b: &CpuBackend) -> u64 {
        CpuStats::get(&b.stats().replays)
    }
    fn require_workspace(&self, _b: &mut CpuBackend, _bytes: u64) -> bool {
        false
    }
}

contract_tests!(Some(Cpu));
