//! The paged KV cache's host side: which physical block holds which logical
//! block of which sequence.
//!
//! The device caches are allocated once by the engine (one K and one V buffer
//! per layer, `num_blocks * block_size` slots each). This module only hands
//! out block numbers: a free list over every block except the reserved null
//! block, a block table per sequence, and the slot a position maps to.
//! Growing a sequence is all-or-nothing: when the free blocks cannot cover
//! it, nothing is taken and the caller gets [`EngineError::KvExhausted`] for
//! that sequence alone.
//!
//! Not here: preemption, swapping, prefix sharing (blocks are never shared,
//! so no reference counts).

use crate::error::EngineError;
use kiln_ir::plan::KvLayout;

/// Block allocator and slot arithmetic for one KV layout.
#[derive(Debug, Clone)]
pub struct KvManager {
    free: Vec<u32>,
    usable: u32,
    block_size: u32,
    null_block: u32,
    max_blocks_per_seq: u32,
}

impl KvManager {
    pub fn new(layout: &KvLayout) -> KvManager {
        // Pop from the end, so blocks are handed out in increasing order.
        let free: Vec<u32> = (0..layout.num_blocks)
            .rev()
            .filter(|&b| b != layout.null_block)
            .collect();
        KvManager {
            usable: free.len() as u32,
            free,
            block_size: layout.block_size,
            null_block: layout.null_block,
            max_blocks_per_seq: layout.max_blocks_per_seq,
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    pub fn free_blocks(&self) -> u32 {
        self.free.len() as u32
    }
    /// Blocks a sequence may own (all but the null block).
    pub fn usable_blocks(&self) -> u32 {
        self.usable
    }
    pub fn null_block(&self) -> u32 {
        self.null_block
    }
    /// The slot padding rows write their K/V to.
    pub fn null_slot(&self) -> u32 {
        self.null_block * self.block_size
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` so it covers positions `[0, tokens)`. All or nothing.
    pub fn ensure(&mut self, table: &mut Vec<u32>, tokens: u32) -> Result<(), EngineError> {
        let want = self.blocks_for(tokens);
        if want > self.max_blocks_per_seq {
            return Err(EngineError::BadPlan(format!(
                "a sequence of {tokens} tokens needs {want} blocks but block tables hold {}",
                self.max_blocks_per_seq
            )));
        }
        let have = table.len() as u32;
        if want <= have {
            return Ok(());
        }
        let needed = want - have;
        if needed > self.free_blocks() {
            return Err(EngineError::KvExhausted {
                needed,
                free: self.free_blocks(),
                usable: self.usable,
                block_size: self.block_size,
            });
        }
        for _ in 0..needed {
            table.push(self.free.pop().expect("checked above"));
        }
        Ok(())
    }

    /// Returns a sequence's blocks to the free list.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            debug_assert!(b != self.null_block && !self.free.contains(&b));
            self.free.push(b);
        }
    }

    /// The slot position `pos` of a sequence with block table `table` lives in.
    pub fn slot(&self, table: &[u32], pos: u32) -> u32 {
        table[(pos / self.block_size) as usize] * self.block_size + pos % self.block_size
    }

    /// Writes a block table row: the sequence's blocks, then the null block.
    pub fn fill_row(&self, table: &[u32], row: &mut [i32]) {
        for (i, r) in row.iter_mut().enumerate() {
            *r = table.get(i).copied().unwrap_or(self.null_block) as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::DType;

    fn layout(num_blocks: u32, block_size: u32) -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 1,
            head_dim: 4,
            dtype: DType::F32,
            block_size,
            num_blocks,
            null_block: 0,
            max_blocks_per_seq: num_blocks,
        }
    }

    #[test]
    fn the_null_block_is_never_handed_out() {
        let mut kv = KvManager::new(&layout(5, 4));
        assert_eq!(kv.usable_blocks(), 4);
        let mut t = Vec::new();
        kv.ensure(&mut t, 16).unwrap();
        assert_eq!(t, vec![1, 2, 3, 4]);
        assert!(matches!(
            kv.ensure(&mut t, 17),
            Err(EngineError::BadPlan(_)) | Err(EngineError::KvExhausted { .. })
        ));
    }

    #[test]
    fn slots_follow_the_block_table() {
        let mut kv = KvManager::new(&layout(8, 4));
        let mut a = Vec::new();
        let mut b = Vec::new();
        kv.ensure(&mut a, 3).unwrap(); // block 1
        kv.ensure(&mut b, 5).unwrap(); // blocks 2, 3
        kv.ensure(&mut a, 6).unwrap(); // block 4
        assert_eq!(a, vec![1, 4]);
        assert_eq!(kv.slot(&a, 0), 4);
        assert_eq!(kv.slot(&a, 5), 4 * 4 + 1);
        assert_eq!(kv.slot(&b, 4), 3 * 4);
        let mut row = [7i32; 4];
        kv.fill_row(&a, &mut row);
        assert_eq!(row, [1, 4, 0, 0]);
        assert_eq!(kv.null_slot(), 0);
    }

    #[test]
    fn exhaustion_refuses_one_sequence_and_takes_nothing() {
        let mut kv = KvManager::new(&layout(6, 2)); // 5 usable blocks
        let mut a = Vec::new();
        let mut b = Vec::new();
        kv.ensure(&mut a, 6).unwrap(); // 3 blocks
        let e = kv.ensure(&mut b, 7).unwrap_err(); // needs 4, 2 free
        match e {
            EngineError::KvExhausted { needed, free, .. } => assert_eq!((needed, free), (4, 2)),
            other => panic!("{other}"),
        }
        assert!(b.is_empty() && kv.free_blocks() == 2);
        // The other sequence goes on.
        kv.ensure(&mut a, 8).unwrap();
        kv.release(&mut a);
        assert_eq!(kv.free_blocks(), 5);
        kv.ensure(&mut b, 7).unwrap();
    }

    #[test]
    fn released_blocks_are_reused_and_never_duplicated() {
        let mut kv = KvManager::new(&layout(9, 1));
        let mut tables: Vec<Vec<u32>> = vec![Vec::new(); 4];
        let mut s = 0x9e3779b97f4a7c15u64;
        for _ in 0..500 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let i = (s % 4) as usize;
            if s.is_multiple_of(3) {
                kv.release(&mut tables[i]);
            } else {
                let len = tables[i].len() as u32 + 1 + (s >> 8) as u32 % 2;
                let _ = kv.ensure(&mut tables[i], len);
            }
            let mut all: Vec<u32> = tables.iter().flatten().copied().collect();
            all.extend(&kv.free);
            all.sort();
            assert_eq!(all, (1..9).collect::<Vec<_>>());
        }
    }
}
