//! The order in which a round sends its blocks.
//!
//! Memory's compressibility comes in stretches of tens to hundreds of MiB: kernel text and
//! page cache, freed and zeroed memory, heaps. Sent in memory order, a compressed round
//! alternates between stretches that compress well, where the compressing writers bound the
//! pace and the link waits, and stretches that do not, where the link bounds it and the CPU
//! waits; the socket buffers between the two smooth milliseconds, not seconds. Each
//! connection's blocks are therefore dealt into [`SPREAD_WAYS`] stretches of memory that are
//! taken in turn, a block from each: at any moment the writers compress a mix of all kinds of
//! memory, and the CPU and the link both work through the whole round. A block still travels
//! on its own connection ([`crate::protocol::block_connection`]), and each block's dirty bits
//! are cleared just before it is queued, whatever the order.

/// Stretches of memory a connection's blocks are taken from in turn (4, 8, 32 and 64 were
/// measured against it: docs/benchmarks.md, "A round's order").
pub(super) const SPREAD_WAYS: usize = 16;

/// The order in which to queue blocks whose connections are `conns` (in memory order): each
/// connection's blocks in [`spread`] order, the connections taken in turn, so that every
/// writer always has work queued.
pub(super) fn send_order(conns: &[usize], connections: usize) -> Vec<usize> {
    let connections = connections.max(1);
    let mut per_conn: Vec<Vec<usize>> = vec![Vec::new(); connections];
    for (i, &c) in conns.iter().enumerate() {
        per_conn[c % connections].push(i);
    }
    let spread: Vec<Vec<usize>> = per_conn
        .iter()
        .map(|blocks| {
            spread(blocks.len(), SPREAD_WAYS)
                .map(|k| blocks[k])
                .collect()
        })
        .collect();
    let longest = spread.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest)
        .flat_map(|step| spread.iter().filter_map(move |s| s.get(step).copied()))
        .collect()
}

/// The indices `0..len` dealt into `ways` consecutive stretches of (nearly) equal length, then
/// taken a stretch at a time in turn: the first of each stretch, the second of each, and so on.
fn spread(len: usize, ways: usize) -> impl Iterator<Item = usize> {
    let ways = ways.clamp(1, len.max(1));
    let start = move |j: usize| j * len / ways;
    let longest = (0..ways)
        .map(|j| start(j + 1) - start(j))
        .max()
        .unwrap_or(0);
    (0..longest).flat_map(move |step| {
        (0..ways).filter_map(move |j| Some(start(j) + step).filter(|&i| i < start(j + 1)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_permutation(order: &[usize], len: usize) -> bool {
        let mut seen = vec![false; len];
        order.len() == len
            && order
                .iter()
                .all(|&i| i < len && !std::mem::replace(&mut seen[i], true))
    }

    #[test]
    fn spread_takes_every_stretch_in_turn() {
        let order: Vec<usize> = spread(10, 3).collect();
        // Stretches 0..3, 3..6, 6..10.
        assert_eq!(order, [0, 3, 6, 1, 4, 7, 2, 5, 8, 9]);
        for (len, ways) in [(0, 16), (1, 16), (5, 16), (16, 16), (1000, 16), (1001, 7)] {
            let order: Vec<usize> = spread(len, ways).collect();
            assert!(is_permutation(&order, len), "{len} {ways}: {order:?}");
        }
        assert_eq!(spread(4, 1).collect::<Vec<_>>(), [0, 1, 2, 3]);
    }

    #[test]
    fn each_connection_gets_its_blocks_spread_and_in_turn() {
        // 64 blocks alternating over two connections, as block_connection deals them.
        let conns: Vec<usize> = (0..64).map(|b| b % 2).collect();
        let order = send_order(&conns, 2);
        assert!(is_permutation(&order, 64));
        // The connections alternate.
        assert!(order.iter().enumerate().all(|(k, &b)| conns[b] == k % 2));
        // The first blocks come from all over memory, not from its start.
        let first: Vec<usize> = order[..32].to_vec();
        assert!(first.iter().any(|&b| b >= 48), "{first:?}");
    }

    #[test]
    fn a_connection_with_more_blocks_goes_on_alone() {
        let conns = [0, 0, 0, 1, 0, 0];
        let order = send_order(&conns, 2);
        assert!(is_permutation(&order, conns.len()));
        assert_eq!(conns[order[1]], 1);
        assert!(order[2..].iter().all(|&b| conns[b] == 0));
    }
}
