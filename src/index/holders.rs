//! Sparse holder sets: which pod slots hold a block.
//!
//! A pool has up to [`MAX_PODS`] (1,024) pods, but a block lives on one to a
//! few of them: a conversation's blocks on the pod that served it, a hot
//! system prompt on the handful it was copied to. A 1,024-bit mask per
//! block would cost 128 bytes where a 64-bit one cost 8, so a set is a
//! sorted list of [`Holder`]s instead, kept in 8 bytes ([`CompactSet`], the
//! size of the mask it replaces): up to [`INLINE`] holders inline, or, for
//! a block more pods hold, a reference to a sorted list in a
//! [`HolderArena`] (24 bytes plus 2 per holder). So the tree's node stays
//! 40 bytes and a snapshot entry 16, whatever the pool's size; what a block
//! costs grows only with the pods that hold it.
//!
//! A holder is 16 bits: the pod slot in the low [`SLOT_BITS`] (10), the
//! [`Tier`] the pod holds the block in at bits 10–11 ([`TIER_SHIFT`]: 0 GPU,
//! 1 CPU, 2 disk; 3 is no holder), bits 12–14 spare, bit 15 reserved for
//! the inline storage's markers (empty, overflow), which are never
//! holders. So a block's tier per pod costs no byte: a tree node stays 40
//! bytes and a snapshot entry 16. Sets are ordered by slot (one entry per
//! slot, whatever its tier), so intersections and differences are linear
//! merges.

use crate::config::MAX_PODS;
use crate::report::Tier;

/// Bits of a [`Holder`] naming its pod slot (2^10 = [`MAX_PODS`]).
pub const SLOT_BITS: u32 = 10;

const SLOT_MASK: u16 = (1 << SLOT_BITS) - 1;

/// Where a holder's [`Tier`] sits (2 bits).
pub const TIER_SHIFT: u32 = SLOT_BITS;

const TIER_MASK: u16 = 0b11 << TIER_SHIFT;

/// Bit 15: set only in the inline storage's markers.
const MARKER_BIT: u16 = 0x8000;

/// An unused inline entry.
const EMPTY: u16 = 0xFFFF;

/// The first inline entry of a set kept in the arena.
const OVERFLOW: u16 = 0xFFFE;

/// Holders kept in the set's own 8 bytes.
pub const INLINE: usize = 4;

/// One pod holding a block (see the module documentation for the bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holder(u16);

impl Holder {
    /// The holder of pod slot `slot` in GPU memory; `None` past
    /// [`MAX_PODS`].
    pub fn new(slot: usize) -> Option<Holder> {
        Holder::in_tier(slot, Tier::Gpu)
    }

    /// The holder of pod slot `slot` in `tier`; `None` past [`MAX_PODS`].
    pub fn in_tier(slot: usize, tier: Tier) -> Option<Holder> {
        (slot < MAX_PODS).then_some(Holder(slot as u16 | (tier.index() as u16) << TIER_SHIFT))
    }

    /// A holder as encoded (`None`: a marker, a slot past [`MAX_PODS`], or
    /// no tier).
    pub fn from_bits(bits: u16) -> Option<Holder> {
        let tier = usize::from((bits & TIER_MASK) >> TIER_SHIFT);
        (bits & MARKER_BIT == 0
            && usize::from(bits & SLOT_MASK) < MAX_PODS
            && tier < Tier::ALL.len())
        .then_some(Holder(bits))
    }

    /// Its 16 bits, as encoded in the snapshot.
    pub fn bits(self) -> u16 {
        self.0
    }

    pub fn slot(self) -> usize {
        usize::from(self.0 & SLOT_MASK)
    }

    /// The tier the pod holds the block in.
    pub fn tier(self) -> Tier {
        let index = usize::from((self.0 & TIER_MASK) >> TIER_SHIFT);
        Tier::ALL.get(index).copied().unwrap_or(Tier::Disk)
    }
}

/// Position of `slot` in a set ordered by slot.
fn search(set: &[Holder], slot: usize) -> Result<usize, usize> {
    set.binary_search_by_key(&slot, |h| h.slot())
}

/// Whether `set` holds `slot`.
pub fn contains(set: &[Holder], slot: usize) -> bool {
    search(set, slot).is_ok()
}

/// Holders in both sets (each ordered by slot), in order.
pub fn intersection(a: &[Holder], b: &[Holder]) -> Vec<Holder> {
    merge(a, b, false, |in_a, in_b| in_a && in_b)
}

/// Holders of `a` missing from `b`, in order.
pub fn difference(a: &[Holder], b: &[Holder]) -> Vec<Holder> {
    merge(a, b, false, |in_a, in_b| in_a && !in_b)
}

/// Holders of either set, in order (where both hold a slot, the entry of
/// the faster tier: a pod holding a block in two places can use the
/// faster copy).
pub fn union(a: &[Holder], b: &[Holder]) -> Vec<Holder> {
    merge(a, b, true, |in_a, in_b| in_a || in_b)
}

/// A linear merge of two sets ordered by slot, keeping the slots for which
/// `keep(in a, in b)` holds; where both hold a slot, `a`'s entry, or with
/// `faster` the entry of the faster tier.
fn merge(
    a: &[Holder],
    b: &[Holder],
    faster: bool,
    keep: impl Fn(bool, bool) -> bool,
) -> Vec<Holder> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    loop {
        let (x, y) = (a.get(i), b.get(j));
        let (holder, in_a, in_b) = match (x, y) {
            (None, None) => return out,
            (Some(&x), None) => (x, true, false),
            (None, Some(&y)) => (y, false, true),
            (Some(&x), Some(&y)) => match x.slot().cmp(&y.slot()) {
                std::cmp::Ordering::Less => (x, true, false),
                std::cmp::Ordering::Greater => (y, false, true),
                std::cmp::Ordering::Equal if faster && y.tier() < x.tier() => (y, true, true),
                std::cmp::Ordering::Equal => (x, true, true),
            },
        };
        i += usize::from(in_a);
        j += usize::from(in_b);
        if keep(in_a, in_b) {
            out.push(holder);
        }
    }
}

/// Lists of the sets with more than [`INLINE`] holders, reused through a
/// free list.
#[derive(Debug, Clone, Default)]
pub struct HolderArena {
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl HolderArena {
    fn list(&self, index: u32) -> &[Holder] {
        self.lists.get(index as usize).map_or(&[], Vec::as_slice)
    }

    fn list_mut(&mut self, index: u32) -> Option<&mut Vec<Holder>> {
        self.lists.get_mut(index as usize)
    }

    fn alloc(&mut self, list: Vec<Holder>) -> u32 {
        match self.free.pop() {
            Some(index) => {
                if let Some(slot) = self.lists.get_mut(index as usize) {
                    *slot = list;
                }
                index
            }
            None => {
                self.lists.push(list);
                (self.lists.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, index: u32) {
        if let Some(list) = self.lists.get_mut(index as usize) {
            *list = Vec::new();
            self.free.push(index);
        }
    }

    /// Lists in use.
    pub fn len(&self) -> usize {
        self.lists.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes of the arena.
    pub fn memory_bytes(&self) -> usize {
        self.lists.capacity() * std::mem::size_of::<Vec<Holder>>()
            + self
                .lists
                .iter()
                .map(|l| l.capacity() * std::mem::size_of::<Holder>())
                .sum::<usize>()
            + self.free.capacity() * 4
    }
}

/// A holder set in 8 bytes: up to [`INLINE`] holders inline (ordered by
/// slot, unused entries marked), or the index of a list in a
/// [`HolderArena`]. Every call that reads or changes it takes the arena it
/// was built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactSet([Holder; INLINE]);

impl Default for CompactSet {
    fn default() -> Self {
        CompactSet::EMPTY
    }
}

impl CompactSet {
    pub const EMPTY: CompactSet = CompactSet([Holder(EMPTY); INLINE]);

    fn overflow(index: u32) -> CompactSet {
        CompactSet([
            Holder(OVERFLOW),
            Holder(index as u16),
            Holder((index >> 16) as u16),
            Holder(EMPTY),
        ])
    }

    fn arena_index(&self) -> Option<u32> {
        let [first, low, high, _] = self.0;
        (first.0 == OVERFLOW).then(|| u32::from(low.0) | u32::from(high.0) << 16)
    }

    /// The holders, ordered by slot.
    pub fn holders<'a>(&'a self, arena: &'a HolderArena) -> &'a [Holder] {
        match self.arena_index() {
            Some(index) => arena.list(index),
            None => {
                let len = self.0.iter().position(|h| h.0 == EMPTY).unwrap_or(INLINE);
                self.0.get(..len).unwrap_or_default()
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        let [first, ..] = self.0;
        first.0 == EMPTY
    }

    /// Adds `holder` (replacing the entry of its slot, if any); whether
    /// its slot was new.
    pub fn insert(&mut self, arena: &mut HolderArena, holder: Holder) -> bool {
        let at = match search(self.holders(arena), holder.slot()) {
            Ok(at) => {
                self.replace_at(arena, at, holder);
                return false;
            }
            Err(at) => at,
        };
        if let Some(index) = self.arena_index() {
            if let Some(list) = arena.list_mut(index) {
                list.insert(at, holder);
            }
            return true;
        }
        let len = self.holders(arena).len();
        if len < INLINE {
            // Shift the tail right by one within the inline entries.
            if let Some(tail) = self.0.get_mut(at..=len) {
                tail.rotate_right(1);
            }
            if let Some(entry) = self.0.get_mut(at) {
                *entry = holder;
            }
        } else {
            let mut list = Vec::with_capacity(INLINE * 2);
            list.extend_from_slice(&self.0);
            list.insert(at, holder);
            *self = CompactSet::overflow(arena.alloc(list));
        }
        true
    }

    fn replace_at(&mut self, arena: &mut HolderArena, at: usize, holder: Holder) {
        let entry = match self.arena_index() {
            Some(index) => arena.list_mut(index).and_then(|l| l.get_mut(at)),
            None => self.0.get_mut(at),
        };
        if let Some(entry) = entry {
            *entry = holder;
        }
    }

    /// Removes `slot`'s holder; whether it was there.
    pub fn remove(&mut self, arena: &mut HolderArena, slot: usize) -> bool {
        let Ok(at) = search(self.holders(arena), slot) else {
            return false;
        };
        match self.arena_index() {
            Some(index) => {
                let Some(list) = arena.list_mut(index) else {
                    return false;
                };
                list.remove(at);
                if list.len() <= INLINE {
                    let mut inline = CompactSet::EMPTY;
                    for (entry, &holder) in inline.0.iter_mut().zip(list.iter()) {
                        *entry = holder;
                    }
                    arena.release(index);
                    *self = inline;
                }
            }
            None => {
                if let Some(tail) = self.0.get_mut(at..) {
                    tail.rotate_left(1);
                }
                if let Some(last) = self.0.last_mut() {
                    *last = Holder(EMPTY);
                }
            }
        }
        true
    }

    /// Makes the set `holders` (ordered by slot).
    pub fn assign(&mut self, arena: &mut HolderArena, holders: &[Holder]) {
        if let Some(index) = self.arena_index() {
            if holders.len() > INLINE {
                if let Some(list) = arena.list_mut(index) {
                    list.clear();
                    list.extend_from_slice(holders);
                }
                return;
            }
            arena.release(index);
        }
        self.store(arena, holders.to_vec());
    }

    /// Stores `list` in a set that holds no arena list.
    fn store(&mut self, arena: &mut HolderArena, list: Vec<Holder>) {
        if list.len() > INLINE {
            *self = CompactSet::overflow(arena.alloc(list));
        } else {
            *self = CompactSet::EMPTY;
            for (entry, holder) in self.0.iter_mut().zip(list) {
                *entry = holder;
            }
        }
    }

    /// Empties the set, returning its arena list, if any.
    pub fn clear(&mut self, arena: &mut HolderArena) {
        if let Some(index) = self.arena_index() {
            arena.release(index);
        }
        *self = CompactSet::EMPTY;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(slots: &[usize]) -> Vec<Holder> {
        slots.iter().map(|&s| Holder::new(s).unwrap()).collect()
    }

    fn slots(holders: &[Holder]) -> Vec<usize> {
        holders.iter().map(|h| h.slot()).collect()
    }

    #[test]
    fn a_set_moves_to_the_arena_past_four_holders_and_back() {
        let mut arena = HolderArena::default();
        let mut s = CompactSet::EMPTY;
        assert!(s.is_empty());
        for slot in [9, 3, 1023, 0] {
            assert!(s.insert(&mut arena, Holder::new(slot).unwrap()));
        }
        assert!(!s.insert(&mut arena, Holder::new(3).unwrap()));
        assert_eq!(slots(s.holders(&arena)), [0, 3, 9, 1023]);
        assert!(arena.is_empty(), "four fit inline");
        assert!(s.insert(&mut arena, Holder::new(5).unwrap()));
        assert_eq!(slots(s.holders(&arena)), [0, 3, 5, 9, 1023]);
        assert_eq!(arena.len(), 1);
        assert!(s.remove(&mut arena, 9));
        assert!(!s.remove(&mut arena, 9));
        assert_eq!(slots(s.holders(&arena)), [0, 3, 5, 1023]);
        assert!(arena.is_empty(), "back inline, its list freed");
        s.assign(&mut arena, &set(&(0..700).collect::<Vec<_>>()));
        assert_eq!(s.holders(&arena).len(), 700);
        let mut other = CompactSet::EMPTY;
        other.assign(&mut arena, &set(&[1, 2, 3, 4, 5, 6]));
        assert_eq!(arena.len(), 2);
        s.clear(&mut arena);
        assert!(s.is_empty() && s.holders(&arena).is_empty());
        assert_eq!(arena.len(), 1);
        assert_eq!(slots(other.holders(&arena)), [1, 2, 3, 4, 5, 6]);
        assert_eq!(std::mem::size_of::<CompactSet>(), 8);
    }

    #[test]
    fn holders_carry_their_tier_beside_the_slot() {
        let cpu = Holder::in_tier(17, Tier::Cpu).unwrap();
        assert_eq!((cpu.slot(), cpu.tier()), (17, Tier::Cpu));
        assert_eq!(Holder::from_bits(cpu.bits()), Some(cpu));
        let disk = Holder::in_tier(1023, Tier::Disk).unwrap();
        assert_eq!((disk.slot(), disk.tier()), (1023, Tier::Disk));
        assert_eq!(Holder::new(5).unwrap().tier(), Tier::Gpu);
        assert_eq!(
            Holder::from_bits(3 << TIER_SHIFT | 17),
            None,
            "no fourth tier"
        );
        assert_eq!(Holder::from_bits(EMPTY), None);
        assert_eq!(Holder::from_bits(OVERFLOW), None);
        assert_eq!(Holder::new(MAX_PODS), None);
        // The same slot in another tier replaces the holder in a set.
        let mut arena = HolderArena::default();
        let mut s = CompactSet::EMPTY;
        s.insert(&mut arena, Holder::new(17).unwrap());
        assert!(!s.insert(&mut arena, cpu));
        assert_eq!(s.holders(&arena), [cpu]);
        assert_eq!(std::mem::size_of::<CompactSet>(), 8, "tiers cost no byte");
    }

    #[test]
    fn a_union_keeps_the_faster_copy_an_intersection_the_first_set_s() {
        let gpu = |s| Holder::new(s).unwrap();
        let cpu = |s| Holder::in_tier(s, Tier::Cpu).unwrap();
        assert_eq!(
            union(&[cpu(1), gpu(2)], &[gpu(1), cpu(2)]),
            [gpu(1), gpu(2)]
        );
        assert_eq!(intersection(&[cpu(1)], &[gpu(1)]), [cpu(1)]);
        assert_eq!(intersection(&[gpu(1)], &[cpu(1)]), [gpu(1)]);
    }

    #[test]
    fn set_operations_merge_by_slot() {
        let (a, b) = (set(&[1, 4, 7, 9]), set(&[0, 4, 9, 12]));
        assert_eq!(slots(&intersection(&a, &b)), [4, 9]);
        assert_eq!(slots(&difference(&a, &b)), [1, 7]);
        assert_eq!(slots(&union(&a, &b)), [0, 1, 4, 7, 9, 12]);
        assert!(contains(&a, 7) && !contains(&a, 8));
    }
}
