//! Tile packs kept from one step to the next. On CPUs with AMX a prompt's run attends from bf16
//! packs of its KV heads' positions (`kernels::attn_amx::Packed`), made by every layer. A long
//! prompt prefilled in short chunks beside streaming replies would pack its whole context again
//! every step, work that grows with the context however short the chunk (at 5,000 positions
//! about a fifth of a 24-token step: docs/performance.md, "Attention on the tile units"). Kept
//! across steps, only the positions a step adds are packed, with the rest of the 32-position
//! block they start in.
//!
//! A pack holds while the cache blocks it was made from hold the same rows. It records, per
//! layer, each block's id and write stamp (`kv_cache::Written`); a sequence keeps the leading
//! positions whose blocks are the same ids and unwritten since. Whatever else happens to a block
//! (freed and given to another sequence, a context shift, a copy, a rewrite) changes its stamp,
//! and the positions from there are packed again. Packs are matched to the next step's
//! sequences by block table: a sequence that shares a cached prefix may take another's packs,
//! which is right, as the same blocks hold the same rows. Packs no sequence takes are dropped.
//!
//! Memory: only sequences whose prompt goes on in a later step keep their packs, at most
//! `KEEP` of them (the longest contexts); each keeps a copy of its KV positions in bf16 for every
//! layer, as much memory as its F16 cache holds. The other runs on the tiles share one layer's
//! packs across the layers, as before. Pure bookkeeping: the packing is `attn_amx`'s.

use std::cmp::Reverse;

use crate::kv_cache::Written;
use crate::model::kernels::amx::KB;
use crate::model::kernels::attn_amx::Packed;

/// Sequences whose packs are kept between steps.
pub(crate) const KEEP: usize = 2;

/// One layer's packs of one sequence (a pack per KV head) and the blocks they were made from.
#[derive(Debug, Default)]
pub(crate) struct LayerPacks {
    /// Positions packed (by every head).
    n: usize,
    blocks: Vec<u32>,
    stamps: Vec<u64>,
    pub(crate) heads: Vec<Packed>,
}

impl LayerPacks {
    /// The leading positions these packs hold for a sequence with block table `table`: those
    /// in leading blocks that are the same ids, with the same stamps in `written` (the layer
    /// about to be packed), as when they were recorded, in whole 32-position blocks (what
    /// `Packed::pack_from` keeps). 0 without stamps.
    pub(crate) fn kept(&self, table: &[u32], written: Option<&Written>) -> usize {
        let Some(w) = written else { return 0 };
        let held = if self.heads.is_empty() { 0 } else { self.n };
        let same = (self.blocks.iter().zip(&self.stamps).zip(table))
            .take_while(|((&b, &s), &t)| b == t && w.stamp(b) == s)
            .count();
        held.min(same * w.block_size) / KB * KB
    }

    /// Records the blocks of `table` that hold positions `0..n`, with their stamps now (the
    /// heads are then packed to `n`).
    pub(crate) fn record(&mut self, table: &[u32], n: usize, written: Option<&Written>) {
        self.n = n;
        self.blocks.clear();
        self.stamps.clear();
        if let Some(w) = written {
            let blocks = &table[..n.div_ceil(w.block_size).min(table.len())];
            self.blocks.extend_from_slice(blocks);
            self.stamps.extend(blocks.iter().map(|&b| w.stamp(b)));
        }
    }
}

/// One sequence's packs for a step: per layer when they are kept across steps (`per_layer`),
/// else one layer's, packed again by each layer.
#[derive(Debug, Default)]
pub(crate) struct SeqPacks {
    per_layer: bool,
    /// Kept after the step (the sequence's prompt goes on).
    goes_on: bool,
    layers: Vec<LayerPacks>,
}

impl SeqPacks {
    /// Packs that last a step: one layer's, reused by every layer.
    pub(crate) fn for_the_step() -> Self {
        SeqPacks::default()
    }

    /// Layer `layer`'s packs, `heads` of them (fresh ones if the shape changed).
    pub(crate) fn layer(&mut self, layer: usize, heads: usize) -> &mut LayerPacks {
        let i = if self.per_layer { layer } else { 0 };
        if self.layers.len() <= i {
            self.layers.resize_with(i + 1, LayerPacks::default);
        }
        let l = &mut self.layers[i];
        if l.heads.len() != heads {
            *l = LayerPacks::default();
            l.heads.resize_with(heads, Packed::default);
        }
        l
    }

    /// Layer `layer`'s packs as `layer` left them.
    pub(crate) fn heads(&self, layer: usize) -> &[Packed] {
        let i = if self.per_layer { layer } else { 0 };
        self.layers.get(i).map_or(&[], |l| &l.heads)
    }

    /// The leading blocks these packs and `table` have in common (in the first layer that
    /// recorded any).
    fn common(&self, table: &[u32]) -> usize {
        let Some(l) = self.layers.iter().find(|l| !l.blocks.is_empty()) else {
            return 0;
        };
        (l.blocks.iter().zip(table))
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// The most positions any of its layers holds.
    fn positions(&self) -> usize {
        self.layers.iter().map(|l| l.n).max().unwrap_or(0)
    }
}

/// The packs kept between steps (a model's, behind its lock).
#[derive(Debug, Default)]
pub(crate) struct PackStore {
    kept: Vec<SeqPacks>,
}

impl PackStore {
    /// Packs for sequences with these block tables (in order), each with whether its prompt
    /// goes on after the step: each takes the kept packs with the most leading blocks in common
    /// with it, if any; else one that goes on gets new packs per layer, one that does not the
    /// step's. Kept packs no sequence takes are dropped.
    pub(crate) fn take(&mut self, tables: &[(&[u32], bool)]) -> Vec<SeqPacks> {
        let mut kept = std::mem::take(&mut self.kept);
        (tables.iter())
            .map(|&(t, goes_on)| {
                let best = (kept.iter().enumerate())
                    .map(|(i, p)| (i, p.common(t)))
                    .filter(|&(_, c)| c > 0)
                    .max_by_key(|&(_, c)| c);
                let mut p = match best {
                    Some((i, _)) => kept.swap_remove(i),
                    None if goes_on => SeqPacks::default(),
                    None => return SeqPacks::for_the_step(),
                };
                p.per_layer = true;
                p.goes_on = goes_on;
                p
            })
            .collect()
    }

    /// Keeps, of a step's packs, those of sequences that go on with the most positions (at
    /// most `KEEP`).
    pub(crate) fn put(&mut self, packs: impl IntoIterator<Item = SeqPacks>) {
        let mut kept: Vec<SeqPacks> = packs.into_iter().filter(|p| p.goes_on).collect();
        kept.sort_by_key(|p| Reverse(p.positions()));
        kept.truncate(KEEP);
        self.kept = kept;
    }

    /// How many sequences' packs are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.kept.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{KvCache, KvCacheSpec, KvDtype, KvShape};
    use candle_core::{Device, Tensor};

    fn cache() -> KvCache {
        let shape = KvShape {
            layers: 2,
            kv_dim: 8,
            heads: 2,
        };
        let spec = KvCacheSpec {
            block_size: 16,
            num_blocks: 10,
        };
        KvCache::new(shape, spec, KvDtype::F16, &Device::Cpu).unwrap()
    }

    /// Writes one row into block `block` of `layer`.
    fn write(c: &KvCache, layer: usize, block: u32) {
        let rows = Tensor::ones((1, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        let index = c.slot_index(&[block * 16 + 3]).unwrap();
        c.write(layer, &index, &rows, &rows).unwrap();
    }

    fn recorded(table: &[u32], n: usize, w: &Written) -> LayerPacks {
        let mut l = std::mem::take(SeqPacks::default().layer(0, 2));
        l.record(table, n, Some(w));
        l
    }

    #[test]
    fn packs_hold_the_leading_blocks_unwritten_since_in_whole_tile_blocks() {
        let c = cache();
        let table = [3, 5, 7, 1, 2, 4, 6];
        let w0 = c.layer(0).unwrap().written.unwrap();
        let l = recorded(&table, 100, &w0);
        // 100 positions held, 96 of them in whole 32-position blocks.
        assert_eq!(l.kept(&table, Some(&w0)), 96);
        // A longer table (the sequence grew) keeps them too; no stamps, nothing.
        assert_eq!(l.kept(&[3, 5, 7, 1, 2, 4, 6, 8], Some(&w0)), 96);
        assert_eq!(l.kept(&table, None), 0);
        // Another layer's write leaves layer 0's packs as they are.
        write(&c, 1, 2);
        assert_eq!(l.kept(&table, Some(&w0)), 96);
        // A write into the fifth block (positions 64..80) keeps the four before it.
        write(&c, 0, 2);
        assert_eq!(l.kept(&table, Some(&w0)), 64);
        // A different block in second place keeps the first block's 16, no whole tile block.
        assert_eq!(l.kept(&[3, 9, 7, 1, 2, 4, 6], Some(&w0)), 0);
        // A copy into the first block, or a shift onto it, counts as a write.
        let l = recorded(&table, 100, &w0);
        c.copy_slots(9, 3, 4).unwrap();
        assert_eq!(l.kept(&table, Some(&w0)), 0);
        let l = recorded(&table, 100, &w0);
        let rot = crate::kv_cache::storage::KeyRotation {
            heads: 2,
            cos: vec![1.0; 2],
            sin: vec![0.0; 2],
        };
        c.shift_slots(&[9 * 16], &[7 * 16 + 1], &rot).unwrap();
        assert_eq!(l.kept(&table, Some(&w0)), 32);
        // The same block ids in another cache are other rows.
        let other = cache();
        let w = other.layer(0).unwrap().written.unwrap();
        assert_eq!(recorded(&table, 100, &w0).kept(&table, Some(&w)), 0);
    }

    fn packs(table: &[u32], n: usize, w: &Written) -> SeqPacks {
        let mut p = SeqPacks {
            per_layer: true,
            goes_on: true,
            ..SeqPacks::default()
        };
        p.layer(0, 2).record(table, n, Some(w));
        p
    }

    #[test]
    fn each_sequence_takes_the_packs_of_its_own_blocks_and_the_rest_are_dropped() {
        let c = cache();
        let w = c.layer(0).unwrap().written.unwrap();
        let mut store = PackStore::default();
        store.put([packs(&[1, 2, 3], 40, &w), packs(&[4, 5], 20, &w)]);
        assert_eq!(store.len(), 2);
        let got = store.take(&[
            (&[4, 5, 6], true),
            (&[9], true),
            (&[1, 2], false),
            (&[7], false),
        ]);
        assert_eq!(store.len(), 0);
        let n = |p: &SeqPacks| p.positions();
        assert_eq!(got.iter().map(n).collect::<Vec<_>>(), [20, 0, 40, 0]);
        // Per layer but for the last: a prompt that ends with no packs kept packs for the step.
        let per_layer: Vec<bool> = got.iter().map(|p| p.per_layer).collect();
        assert_eq!(per_layer, [true, true, true, false]);
        // After the step the prompts that go on keep theirs (the second's new, still empty),
        // those that end drop them.
        store.put(got);
        let kept: Vec<usize> = store.kept.iter().map(|p| p.positions()).collect();
        assert_eq!(kept, [20, 0]);
    }

    #[test]
    fn at_most_keep_packs_stay_the_longest_and_step_packs_never() {
        let c = cache();
        let w = c.layer(0).unwrap().written.unwrap();
        let mut step = SeqPacks::for_the_step();
        step.layer(0, 2).record(&[8, 9], 30, Some(&w));
        let mut store = PackStore::default();
        store.put([
            packs(&[1], 10, &w),
            step,
            packs(&[2], 30, &w),
            packs(&[3], 20, &w),
        ]);
        let kept: Vec<usize> = store.kept.iter().map(|p| p.positions()).collect();
        assert_eq!(kept, [30, 20]);
        assert_eq!(KEEP, 2);
    }

    #[test]
    fn step_packs_share_one_layer_and_kept_ones_have_one_a_layer() {
        let mut step = SeqPacks::for_the_step();
        step.layer(0, 3).n = 5;
        assert_eq!(step.layer(4, 3).n, 5);
        assert_eq!(step.heads(7).len(), 3);
        let mut kept = SeqPacks {
            per_layer: true,
            ..SeqPacks::default()
        };
        kept.layer(0, 3).n = 5;
        assert_eq!(kept.layer(4, 3).n, 0);
        // A new head count starts over.
        assert_eq!(kept.layer(0, 2).n, 0);
    }
}
