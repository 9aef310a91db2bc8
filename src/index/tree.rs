//! [`PrefixTree`]: chained block hash → pods holding it, as a tree.
//!
//! Nodes live in a slab (`Vec<Node>`, 40 bytes each) found through a
//! `hashbrown::HashTable<u32>` keyed by the block hash itself (already a
//! uniform 64-bit hash, so no re-hashing). Each node keeps its holders (a
//! [`CompactSet`]: up to four pod slots in the node, more in the tree's
//! [`HolderArena`]), its parent, an intrusive child list and intrusive LRU
//! links. So a node costs the same 40 bytes at 1,024 pods as the 64-bit
//! mask it replaced did at 64: a block held by more than four pods adds
//! 24 bytes and 2 per holder.
//!
//! Invariant: a pod holds a node only if it holds the node's parent.
//! - insert: a pod's blocks attach under a parent the pod holds (or at the
//!   root); blocks whose parent the pod does not hold are refused as orphans.
//! - remove (a pod evicted block `h`): the pod leaves `h`'s whole subtree,
//!   and nodes no pod holds any more are freed.
//! - bound: past `max_nodes` the least-recently-stored *leaf* is evicted
//!   (an interior node at the LRU tail gets a second chance), like an
//!   engine's prefix cache, which frees leaves before their prefixes.
//! - share: one pod holds at most `max_pod_blocks` blocks
//!   ([`PrefixTree::set_max_pod_blocks`]); past it the pod's new blocks are
//!   refused, so one pod's flood cannot evict everyone else's blocks.
//!
//! Costs: lookup O(n) probes for an n-block chain (holder sets are
//! compared only where one ends a match: O(n + pods matched)); insert O(n)
//! amortised (O(holders) per block in a set past four); remove O(size of
//! the pruned subtree); memory ≈ 40 B/node + the table + the arena.

// Node ids index the slab and come only from the tree itself (the table,
// links and free list), never from input: indexing them cannot go out of
// bounds while the tree's own invariants hold, which its tests check.
#![allow(clippy::indexing_slicing)]

use hashbrown::HashTable;

use std::borrow::Cow;

use super::holders::{self, CompactSet, Holder, HolderArena};
use super::{MatchBuilder, PrefixLookup, PrefixMatch};
use crate::report::Tier;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node {
    hash: u64,
    holders: CompactSet,
    parent: u32,
    first_child: u32,
    /// Sibling links; `next_sibling` doubles as the free-list link.
    next_sibling: u32,
    prev_sibling: u32,
    /// Towards the most recently used end.
    lru_newer: u32,
    /// Towards the least recently used end.
    lru_older: u32,
}

/// Result of [`PrefixTree::insert_chain`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InsertOutcome {
    /// Blocks the pod now holds (new or refreshed).
    pub stored: usize,
    /// Blocks refused because the pod does not hold their parent, the block
    /// is indexed under another parent, the pod is at its share of the
    /// index, or the index could not make room.
    pub orphaned: usize,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct PrefixTree {
    nodes: Vec<Node>,
    table: HashTable<u32>,
    /// Holder lists of nodes with more than four holders.
    arena: HolderArena,
    free_head: u32,
    /// The first root (a node without a parent): roots are linked through
    /// their sibling links, as children are under their parent, so a
    /// pod's blocks are found from its roots without scanning the slab.
    roots_head: u32,
    len: usize,
    max_nodes: usize,
    max_pod_blocks: usize,
    /// Blocks each pod slot holds (grown to the highest slot seen).
    pod_blocks: Vec<usize>,
    /// Most recently used node.
    lru_newest: u32,
    /// Least recently used node.
    lru_oldest: u32,
    evictions: u64,
    /// Hashes whose holders changed since the last
    /// [`PrefixTree::take_changes`], when change tracking is on.
    changes: Option<Vec<u64>>,
}

impl PrefixTree {
    /// An empty tree holding at most `max_nodes` blocks. Both the slab and
    /// the table are reserved for `max_nodes` up front: growing them later
    /// would copy or rehash everything in one step, a stall of tens of ms
    /// on Envoy's main thread at a million blocks. Pages untouched stay
    /// unbacked, so the reservation costs address space, not memory.
    pub fn new(max_nodes: usize) -> PrefixTree {
        PrefixTree {
            nodes: Vec::with_capacity(max_nodes),
            table: HashTable::with_capacity(max_nodes),
            arena: HolderArena::default(),
            free_head: NIL,
            roots_head: NIL,
            len: 0,
            max_nodes: max_nodes.max(1),
            max_pod_blocks: usize::MAX,
            pod_blocks: Vec::new(),
            lru_newest: NIL,
            lru_oldest: NIL,
            evictions: 0,
            changes: None,
        }
    }

    /// Like [`PrefixTree::new`], also logging every mask change for a
    /// publisher to drain with [`PrefixTree::take_changes`].
    pub fn with_change_log(max_nodes: usize) -> PrefixTree {
        PrefixTree {
            changes: Some(Vec::new()),
            ..PrefixTree::new(max_nodes)
        }
    }

    /// Caps the blocks one pod may hold (blocks already held stay).
    pub fn set_max_pod_blocks(&mut self, max_pod_blocks: usize) {
        self.max_pod_blocks = max_pod_blocks.max(1);
    }

    /// Blocks (nodes) in the index.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Blocks evicted by the global bound so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Heap bytes held by the index.
    pub fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.table.allocation_size()
            + self.arena.memory_bytes()
            + self.pod_blocks.capacity() * std::mem::size_of::<usize>()
            + self.changes.as_ref().map_or(0, |c| c.capacity() * 8)
    }

    /// The pods holding block `hash` (ordered by slot), if indexed.
    pub fn holders(&self, hash: u64) -> Option<&[Holder]> {
        self.find(hash)
            .map(|slot| self.nodes[slot as usize].holders.holders(&self.arena))
    }

    /// The pod slots holding block `hash`, in order (empty: not indexed).
    pub fn pods(&self, hash: u64) -> Vec<usize> {
        self.holders(hash)
            .unwrap_or_default()
            .iter()
            .map(|h| h.slot())
            .collect()
    }

    /// Whether `pod` holds the whole of `chain` in GPU memory: its last
    /// block says so, as a pod's blocks are prefix-closed (a block leaves
    /// with its subtree) and leave the GPU tail first.
    pub fn holds_on_gpu(&self, pod: usize, chain: &[u64]) -> bool {
        chain
            .last()
            .and_then(|&hash| self.holders(hash))
            .and_then(|set| set.iter().find(|h| h.slot() == pod))
            .is_some_and(|h| h.tier() == Tier::Gpu)
    }

    /// The parent block of `hash`, if indexed and not a root.
    pub fn parent(&self, hash: u64) -> Option<u64> {
        let slot = self.find(hash)?;
        let parent = self.nodes[slot as usize].parent;
        (parent != NIL).then(|| self.nodes[parent as usize].hash)
    }

    /// Hashes whose holders changed since the last call (empty unless
    /// built with [`PrefixTree::with_change_log`]); a hash may appear more
    /// than once, and [`PrefixTree::holders`] says what it is now (`None`:
    /// gone).
    pub fn take_changes(&mut self) -> Vec<u64> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Records that `pod` stores the chain `hashes` in GPU memory,
    /// continuing `parent` (`None`: the chain starts at the first block of
    /// a prompt).
    pub fn insert_chain(
        &mut self,
        pod: usize,
        parent: Option<u64>,
        hashes: &[u64],
    ) -> InsertOutcome {
        self.insert_chain_in(pod, parent, hashes, Tier::Gpu)
    }

    /// Like [`PrefixTree::insert_chain`], the blocks held in `tier`: a
    /// block the pod already holds moves to `tier` (its copy was evicted
    /// from the GPU, or reloaded to it).
    pub fn insert_chain_in(
        &mut self,
        pod: usize,
        parent: Option<u64>,
        hashes: &[u64],
        tier: Tier,
    ) -> InsertOutcome {
        let Some(holder) = Holder::in_tier(pod, tier) else {
            return InsertOutcome {
                stored: 0,
                orphaned: hashes.len(),
            };
        };
        let mut parent_slot = match parent {
            None => NIL,
            Some(hash) => match self.find(hash) {
                Some(slot) if self.node_holds(slot, pod) => slot,
                _ => {
                    return InsertOutcome {
                        stored: 0,
                        orphaned: hashes.len(),
                    }
                }
            },
        };
        if parent_slot != NIL {
            self.touch(parent_slot);
        }
        for (i, &hash) in hashes.iter().enumerate() {
            let slot = match self.find(hash) {
                // The same block under another parent (a pod's inconsistent
                // report or a hash collision): holding it would break the
                // invariant, so the rest of the chain is refused.
                Some(slot) if self.nodes[slot as usize].parent != parent_slot => {
                    return InsertOutcome {
                        stored: i,
                        orphaned: hashes.len() - i,
                    }
                }
                Some(slot) if self.node_holds(slot, pod) => slot,
                _ if self.pod_block_count(pod) >= self.max_pod_blocks => {
                    return InsertOutcome {
                        stored: i,
                        orphaned: hashes.len() - i,
                    }
                }
                Some(slot) => slot,
                None => match self.create(hash, parent_slot) {
                    Some(slot) => slot,
                    None => {
                        return InsertOutcome {
                            stored: i,
                            orphaned: hashes.len() - i,
                        }
                    }
                },
            };
            self.add_holder(slot, holder);
            self.touch(slot);
            parent_slot = slot;
        }
        InsertOutcome {
            stored: hashes.len(),
            orphaned: 0,
        }
    }

    /// Records that `pod` evicted `hashes`: it leaves each one's subtree.
    pub fn remove_blocks(&mut self, pod: usize, hashes: &[u64]) {
        for &hash in hashes {
            if let Some(slot) = self.find(hash) {
                self.clear_subtree(slot, pod);
            }
        }
    }

    /// Forgets every block of `pod` (restart, removal, full resync):
    /// O(roots + the pod's blocks).
    pub fn drop_pod(&mut self, pod: usize) {
        let roots = self.roots_of(pod);
        self.remove_blocks(pod, &roots);
    }

    /// The first blocks of the chains `pod` holds (its roots): removing
    /// them ([`PrefixTree::remove_blocks`]) drops all its blocks, in as
    /// many steps as wanted. O(roots): the roots are linked, so the slab
    /// is not scanned (at 1,024 pods a resync of every pod scanning the
    /// slab would scan it 1,024 times).
    pub fn roots_of(&self, pod: usize) -> Vec<u64> {
        let mut roots = Vec::new();
        if self.pod_block_count(pod) == 0 {
            return roots;
        }
        let mut slot = self.roots_head;
        while slot != NIL {
            if self.node_holds(slot, pod) {
                roots.push(self.nodes[slot as usize].hash);
            }
            slot = self.nodes[slot as usize].next_sibling;
        }
        roots
    }

    /// Blocks `pod` holds.
    pub fn pod_block_count(&self, pod: usize) -> usize {
        self.pod_blocks.get(pod).copied().unwrap_or(0)
    }

    fn find(&self, hash: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.table
            .find(hash, |&slot| nodes[slot as usize].hash == hash)
            .copied()
    }

    fn node_holds(&self, slot: u32, pod: usize) -> bool {
        holders::contains(self.nodes[slot as usize].holders.holders(&self.arena), pod)
    }

    fn changed(&mut self, slot: u32) {
        if let Some(changes) = &mut self.changes {
            changes.push(self.nodes[slot as usize].hash);
        }
    }

    fn add_holder(&mut self, slot: u32, holder: Holder) {
        let set = &mut self.nodes[slot as usize].holders;
        let pod = holder.slot();
        let before = set
            .holders(&self.arena)
            .iter()
            .find(|h| h.slot() == pod)
            .copied();
        match before {
            Some(held) if held == holder => return,
            // The pod holds it in another tier now.
            Some(_) => {
                set.insert(&mut self.arena, holder);
            }
            None => {
                set.insert(&mut self.arena, holder);
                if self.pod_blocks.len() <= pod {
                    self.pod_blocks.resize(pod + 1, 0);
                }
                self.pod_blocks[pod] += 1;
            }
        }
        self.changed(slot);
    }

    /// Removes `pod` from the node; whether it held it.
    fn remove_holder(&mut self, slot: u32, pod: usize) -> bool {
        let removed = self.nodes[slot as usize]
            .holders
            .remove(&mut self.arena, pod);
        if removed {
            self.pod_blocks[pod] -= 1;
            self.changed(slot);
        }
        removed
    }

    /// Every pod leaves the node.
    fn clear_holders(&mut self, slot: u32) {
        let node = &mut self.nodes[slot as usize];
        if node.holders.is_empty() {
            return;
        }
        for holder in node.holders.holders(&self.arena) {
            self.pod_blocks[holder.slot()] -= 1;
        }
        node.holders.clear(&mut self.arena);
        self.changed(slot);
    }

    /// A new empty leaf under `parent`, evicting a leaf first when full.
    /// `None` when nothing can be evicted (every node is `parent` or one of
    /// its ancestors).
    fn create(&mut self, hash: u64, parent: u32) -> Option<u32> {
        if self.len >= self.max_nodes && !self.evict_one(parent) {
            return None;
        }
        let node = Node {
            hash,
            holders: CompactSet::EMPTY,
            parent,
            first_child: NIL,
            next_sibling: NIL,
            prev_sibling: NIL,
            lru_newer: NIL,
            lru_older: NIL,
        };
        let slot = if self.free_head != NIL {
            let slot = self.free_head;
            self.free_head = self.nodes[slot as usize].next_sibling;
            self.nodes[slot as usize] = node;
            slot
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        };
        let nodes = &self.nodes;
        self.table
            .insert_unique(hash, slot, |&s| nodes[s as usize].hash);
        let old_first = if parent != NIL {
            std::mem::replace(&mut self.nodes[parent as usize].first_child, slot)
        } else {
            std::mem::replace(&mut self.roots_head, slot)
        };
        self.nodes[slot as usize].next_sibling = old_first;
        if old_first != NIL {
            self.nodes[old_first as usize].prev_sibling = slot;
        }
        self.lru_push_newest(slot);
        self.len += 1;
        Some(slot)
    }

    /// Evicts the least recently used leaf other than `protect`.
    fn evict_one(&mut self, protect: u32) -> bool {
        for _ in 0..self.len {
            let oldest = self.lru_oldest;
            if oldest == NIL {
                return false;
            }
            if oldest == protect || self.nodes[oldest as usize].first_child != NIL {
                self.touch(oldest);
                continue;
            }
            self.clear_holders(oldest);
            self.free_node(oldest);
            self.evictions += 1;
            return true;
        }
        false
    }

    /// Removes `pod` from `root`'s subtree, freeing nodes left with no pod.
    fn clear_subtree(&mut self, root: u32, pod: usize) {
        let mut stack = vec![root];
        while let Some(slot) = stack.pop() {
            if !self.remove_holder(slot, pod) {
                continue; // by the invariant, nothing below holds it either
            }
            if self.nodes[slot as usize].holders.is_empty() {
                self.free_subtree(slot);
            } else {
                let mut child = self.nodes[slot as usize].first_child;
                while child != NIL {
                    stack.push(child);
                    child = self.nodes[child as usize].next_sibling;
                }
            }
        }
    }

    /// Frees `root` and everything below it (all of which hold no pod).
    fn free_subtree(&mut self, root: u32) {
        let mut stack = vec![root];
        while let Some(slot) = stack.pop() {
            let mut child = self.nodes[slot as usize].first_child;
            while child != NIL {
                stack.push(child);
                child = self.nodes[child as usize].next_sibling;
            }
            self.nodes[slot as usize].first_child = NIL;
            self.clear_holders(slot);
            self.free_node(slot);
        }
    }

    /// Unlinks a node with no children from its parent, the LRU list and
    /// the table, and puts it on the free list.
    fn free_node(&mut self, slot: u32) {
        let Node {
            hash,
            parent,
            next_sibling,
            prev_sibling,
            ..
        } = self.nodes[slot as usize];
        if prev_sibling != NIL {
            self.nodes[prev_sibling as usize].next_sibling = next_sibling;
        } else if parent != NIL {
            if self.nodes[parent as usize].first_child == slot {
                self.nodes[parent as usize].first_child = next_sibling;
            }
        } else if self.roots_head == slot {
            self.roots_head = next_sibling;
        }
        if next_sibling != NIL {
            self.nodes[next_sibling as usize].prev_sibling = prev_sibling;
        }
        self.lru_unlink(slot);
        let nodes = &self.nodes;
        if let Ok(entry) = self
            .table
            .find_entry(hash, |&s| nodes[s as usize].hash == hash)
        {
            entry.remove();
        }
        let node = &mut self.nodes[slot as usize];
        node.parent = NIL;
        node.prev_sibling = NIL;
        node.next_sibling = self.free_head;
        self.free_head = slot;
        self.len -= 1;
    }

    fn touch(&mut self, slot: u32) {
        if self.lru_newest != slot {
            self.lru_unlink(slot);
            self.lru_push_newest(slot);
        }
    }

    fn lru_push_newest(&mut self, slot: u32) {
        let old_newest = self.lru_newest;
        let node = &mut self.nodes[slot as usize];
        node.lru_older = old_newest;
        node.lru_newer = NIL;
        if old_newest != NIL {
            self.nodes[old_newest as usize].lru_newer = slot;
        } else {
            self.lru_oldest = slot;
        }
        self.lru_newest = slot;
    }

    fn lru_unlink(&mut self, slot: u32) {
        let Node {
            lru_newer,
            lru_older,
            ..
        } = self.nodes[slot as usize];
        if lru_newer != NIL {
            self.nodes[lru_newer as usize].lru_older = lru_older;
        } else {
            self.lru_newest = lru_older;
        }
        if lru_older != NIL {
            self.nodes[lru_older as usize].lru_newer = lru_newer;
        } else {
            self.lru_oldest = lru_newer;
        }
        let node = &mut self.nodes[slot as usize];
        node.lru_newer = NIL;
        node.lru_older = NIL;
    }
}

impl PrefixLookup for PrefixTree {
    fn lookup(&self, chain: &[u64]) -> PrefixMatch {
        let mut result = MatchBuilder::default();
        // The pods holding the chain so far, and whether they are exactly
        // the holders of the previous block's node (then a child's holders
        // are within them by the invariant, and need no intersection).
        let mut running: Cow<'_, [Holder]> = Cow::Borrowed(&[]);
        let mut previous = NIL;
        for (i, &hash) in chain.iter().enumerate() {
            let Some(slot) = self.find(hash) else {
                result.set_all(&running, i as u32);
                return result.finish();
            };
            let node = &self.nodes[slot as usize];
            let held = node.holders.holders(&self.arena);
            let next: Cow<'_, [Holder]> = if i == 0 || (previous != NIL && node.parent == previous)
            {
                Cow::Borrowed(held)
            } else {
                Cow::Owned(holders::intersection(held, &running))
            };
            if i > 0 && next.len() != running.len() {
                result.set_all(&holders::difference(&running, &next), i as u32);
            }
            for &holder in next.iter() {
                result.held_at(holder, i as u32);
            }
            // An intersection smaller than the node's holders breaks the
            // link to the node: the next block is intersected too.
            previous = if next.len() == held.len() { slot } else { NIL };
            running = next;
            if running.is_empty() {
                return result.finish();
            }
        }
        result.set_all(&running, chain.len() as u32);
        result.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::TierBlocks;

    #[test]
    fn lookup_counts_consecutive_blocks_per_pod() {
        let mut tree = PrefixTree::new(100);
        tree.insert_chain(0, None, &[1, 2, 3, 4]);
        tree.insert_chain(1, None, &[1, 2]);
        tree.insert_chain(1, Some(2), &[5]);
        let m = tree.lookup(&[1, 2, 3, 4, 9]);
        assert_eq!((m.blocks(0), m.blocks(1), m.blocks(2)), (4, 2, 0));
        let m = tree.lookup(&[1, 2, 5]);
        assert_eq!((m.blocks(0), m.blocks(1)), (2, 3));
        assert_eq!(tree.len(), 5);
    }

    #[test]
    fn orphans_are_refused() {
        let mut tree = PrefixTree::new(100);
        tree.insert_chain(0, None, &[1]);
        let outcome = tree.insert_chain(1, Some(1), &[2, 3]);
        assert_eq!(
            outcome,
            InsertOutcome {
                stored: 0,
                orphaned: 2
            }
        );
        assert_eq!(tree.lookup(&[1, 2]).blocks(1), 0);
    }

    #[test]
    fn removal_prunes_exactly_the_pods_subtree() {
        let mut tree = PrefixTree::with_change_log(100);
        tree.insert_chain(0, None, &[1, 2, 3]);
        tree.insert_chain(1, None, &[1, 2]);
        tree.take_changes();
        tree.remove_blocks(0, &[2]);
        assert_eq!(tree.pods(1), [0, 1]);
        assert_eq!(tree.pods(2), [1]);
        assert_eq!(tree.holders(3), None, "no pod holds block 3 any more");
        assert_eq!(tree.len(), 2);
        let mut changes = tree.take_changes();
        changes.sort();
        assert_eq!(changes, vec![2, 3]);
        assert_eq!((tree.pods(1), tree.pods(2)), (vec![0, 1], vec![1]));
        // A re-store of block 2 by pod 0 does not resurrect block 3.
        tree.insert_chain(0, Some(1), &[2]);
        assert_eq!(tree.lookup(&[1, 2, 3]).blocks(0), 2);
    }

    #[test]
    fn roots_are_linked_and_unlinked() {
        let mut tree = PrefixTree::new(100);
        tree.insert_chain(0, None, &[1, 2]);
        tree.insert_chain(1, None, &[3]);
        tree.insert_chain(0, None, &[4, 5]);
        tree.insert_chain(1, None, &[4]);
        let mut roots = tree.roots_of(0);
        roots.sort_unstable();
        assert_eq!(roots, [1, 4]);
        assert_eq!(tree.roots_of(1), [4, 3]);
        tree.remove_blocks(0, &[4]);
        assert_eq!(tree.roots_of(0), [1]);
        tree.remove_blocks(1, &[4, 3]);
        assert!(tree.roots_of(1).is_empty());
        assert_eq!(tree.roots_of(0), [1], "the list survives freed roots");
        tree.insert_chain(2, None, &[6]);
        assert_eq!(tree.roots_of(2), [6]);
        assert_eq!(tree.len(), 3);
    }

    #[test]
    fn drop_pod_forgets_everything_it_held() {
        let mut tree = PrefixTree::new(100);
        tree.insert_chain(0, None, &[1, 2, 3]);
        tree.insert_chain(1, None, &[1, 7]);
        tree.drop_pod(0);
        assert_eq!(tree.pod_block_count(0), 0);
        assert_eq!(tree.len(), 2);
        assert_eq!(tree.lookup(&[1, 7]).blocks(1), 2);
    }

    #[test]
    fn eviction_takes_least_recent_leaves_first() {
        let mut tree = PrefixTree::new(4);
        tree.insert_chain(0, None, &[1, 2, 3]); // system prompt 1-2, conversation 3
        tree.insert_chain(0, Some(2), &[4]); // second conversation
        tree.insert_chain(0, Some(2), &[5]); // third: evicts leaf 3, not root 1
        assert_eq!(tree.len(), 4);
        assert_eq!(tree.holders(3), None);
        assert_eq!(tree.lookup(&[1, 2, 5]).blocks(0), 3);
        assert_eq!(tree.evictions(), 1);
    }

    #[test]
    fn a_chain_longer_than_the_bound_is_truncated_not_corrupted() {
        let mut tree = PrefixTree::new(2);
        let outcome = tree.insert_chain(0, None, &[1, 2, 3, 4]);
        assert!(outcome.stored >= 1 && outcome.stored + outcome.orphaned == 4);
        assert!(tree.len() <= 2);
        let m = tree.lookup(&[1, 2, 3, 4]);
        assert!(m.blocks(0) as usize <= tree.len());
    }

    #[test]
    fn a_pod_s_blocks_carry_their_tier_and_move_between_tiers() {
        let mut tree = PrefixTree::with_change_log(100);
        tree.insert_chain(0, None, &[1, 2, 3, 4]);
        tree.insert_chain(1, None, &[1, 2, 3]);
        tree.take_changes();
        // Pod 0's GPU evicts its tail into the CPU tier, the last block
        // further down to disk.
        tree.insert_chain_in(0, Some(2), &[3, 4], Tier::Cpu);
        tree.insert_chain_in(0, Some(3), &[4], Tier::Disk);
        let mut changes = tree.take_changes();
        changes.sort_unstable();
        changes.dedup();
        assert_eq!(changes, [3, 4], "a tier change is a change to publish");
        assert_eq!(tree.pod_block_count(0), 4, "moved, not added");
        let m = tree.lookup(&[1, 2, 3, 4, 5]);
        assert_eq!(m.blocks(0), 4);
        assert_eq!(
            m.tiers(0),
            TierBlocks {
                gpu: 2,
                cpu: 1,
                disk: 1
            }
        );
        assert_eq!(
            m.tiers(1),
            TierBlocks {
                gpu: 3,
                cpu: 0,
                disk: 0
            }
        );
        // The same tier again changes nothing.
        tree.insert_chain_in(0, Some(2), &[3], Tier::Cpu);
        assert!(tree.take_changes().is_empty());
        // A block counts in the slowest tier of its prefix: a GPU block
        // after a CPU one needs that one reloaded first.
        tree.insert_chain_in(1, None, &[1], Tier::Cpu);
        assert_eq!(
            tree.lookup(&[1, 2, 3]).tiers(1),
            TierBlocks {
                gpu: 0,
                cpu: 3,
                disk: 0
            }
        );
        // Reloaded to the GPU.
        tree.insert_chain(0, None, &[1, 2, 3, 4]);
        assert_eq!(tree.lookup(&[1, 2, 3, 4]).tiers(0).gpu, 4);
        assert!(tree.holds_on_gpu(0, &[1, 2, 3, 4]));
        tree.insert_chain_in(0, Some(3), &[4], Tier::Cpu);
        assert!(!tree.holds_on_gpu(0, &[1, 2, 3, 4]));
        assert!(!tree.holds_on_gpu(2, &[1]));
    }
}
