//! The bookkeeping of asynchronous batches (1.10): which shards of a sharded region are
//! stepping, and which the client has handed to its caller and awaits actions for.
//!
//! A shard is lock-step with its own action counter, so the unit of an asynchronous batch
//! is a shard: [`Client::recv`](crate::Client::recv) hands out the envs of whole shards whose
//! frames arrived, and [`Client::send`](crate::Client::send) takes actions for whole shards
//! it handed out. Each shard is in one of two states:
//!
//! - **stepping**: an action (or the reset of `async_reset`) was posted to it and its frame
//!   not yet handed out; `posted` is the frame it owes;
//! - **held**: its frame was handed out; the caller owes its actions.
//!
//! So an env is never handed out twice before its action was sent (a held shard is not
//! stepping), and an action is posted only to a held shard, once (it becomes stepping).
//! The type is pure bookkeeping: the client reads the frame counters and posts.

use std::ops::Range;

use crate::error::{Error, Result};

#[derive(Debug, Clone)]
struct Entry {
    envs: Range<u32>,
    /// The action last posted to the shard: the frame it owes while stepping.
    posted: u64,
    /// The order number of that post among all of this client's sends (0: the reset):
    /// frame numbers are per shard, so only this says which shard was posted first.
    sent: u64,
    held: bool,
}

/// Where each shard of an asynchronous client stands.
#[derive(Debug, Clone)]
pub struct ReadySet {
    shards: Vec<Entry>,
    /// Scratch for [`ReadySet::check_send`]: which envs a send listed.
    listed: Vec<bool>,
    /// The order number of the last post.
    sends: u64,
}

impl ReadySet {
    /// Every shard stepping towards the frame it has published (`frames[k]`, its envs
    /// `envs[k]`): all of them ready at once (after a reset, which consumes no action).
    pub fn new(shards: impl IntoIterator<Item = (Range<u32>, u64)>) -> ReadySet {
        let shards: Vec<Entry> = shards
            .into_iter()
            .map(|(envs, frame)| Entry {
                envs,
                posted: frame,
                sent: 0,
                held: false,
            })
            .collect();
        let envs = shards.last().map_or(0, |e| e.envs.end as usize);
        ReadySet {
            shards,
            listed: vec![false; envs],
            sends: 0,
        }
    }

    /// The stepping shards and the frame each owes.
    pub fn stepping(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.shards
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.held)
            .map(|(k, e)| (k, e.posted))
    }

    /// The order number of shard `k`'s last post: a shard posted earlier has a smaller
    /// one (the shards of the reset share 0). 0 for a shard out of range.
    pub fn sent(&self, k: usize) -> u64 {
        self.shards.get(k).map_or(0, |e| e.sent)
    }

    /// Whether shard `k` is held: its frame handed out, its actions not sent yet.
    pub fn is_held(&self, k: usize) -> bool {
        self.shards.get(k).is_some_and(|e| e.held)
    }

    /// How many shards are stepping.
    pub fn stepping_count(&self) -> usize {
        self.shards.iter().filter(|e| !e.held).count()
    }

    /// Hands out stepping shard `k`, whose frame arrived: its envs.
    pub fn hand_out(&mut self, k: usize) -> Result<Range<u32>> {
        match self.shards.get_mut(k) {
            Some(e) if !e.held => {
                e.held = true;
                Ok(e.envs.clone())
            }
            _ => Err(Error::OutOfOrder(
                "a shard handed out twice before its actions were sent",
            )),
        }
    }

    /// The shard serving `env`, if any.
    fn shard_of(&self, env: u32) -> Option<usize> {
        let k = self.shards.partition_point(|e| e.envs.end <= env);
        self.shards
            .get(k)
            .filter(|e| e.envs.contains(&env))
            .map(|_| k)
    }

    /// Checks that `env_ids` lists every env of some held shards, each once, and nothing
    /// else; returns those shards in the order first listed. Changes nothing.
    pub fn check_send(&mut self, env_ids: &[u32]) -> Result<Vec<usize>> {
        let out = self.check_listed(env_ids);
        for &e in env_ids {
            if let Some(l) = self.listed.get_mut(e as usize) {
                *l = false;
            }
        }
        out
    }

    fn check_listed(&mut self, env_ids: &[u32]) -> Result<Vec<usize>> {
        let mut shards = Vec::new();
        for &env in env_ids {
            let k = self.shard_of(env).ok_or(Error::NotInBatch {
                env_id: env,
                reason: "no such env in the region",
            })?;
            if !self.shards[k].held {
                return Err(Error::NotInBatch {
                    env_id: env,
                    reason: "its frame was not received (or its action was already sent): \
                             send actions only for the env ids recv() returned, once",
                });
            }
            if std::mem::replace(&mut self.listed[env as usize], true) {
                return Err(Error::NotInBatch {
                    env_id: env,
                    reason: "listed twice",
                });
            }
            if !shards.contains(&k) {
                shards.push(k);
            }
        }
        for &k in &shards {
            let envs = self.shards[k].envs.clone();
            if let Some(missing) = envs.clone().find(|&e| !self.listed[e as usize]) {
                return Err(Error::NotInBatch {
                    env_id: missing,
                    reason: "missing: a shard steps all its envs together, so a send lists \
                             every env of each shard it names",
                });
            }
        }
        Ok(shards)
    }

    /// Held shard `k` gets its next action: it steps again. Returns the action's number.
    /// Each call gets the next order number ([`ReadySet::sent`]).
    pub fn post(&mut self, k: usize) -> Result<u64> {
        self.sends += 1;
        let sends = self.sends;
        match self.shards.get_mut(k) {
            Some(e) if e.held => {
                e.held = false;
                e.posted += 1;
                e.sent = sends;
                Ok(e.posted)
            }
            _ => Err(Error::OutOfOrder(
                "an action posted to a shard that was not handed out",
            )),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn two_by_two() -> ReadySet {
        ReadySet::new([(0..2, 5), (2..4, 5)])
    }

    #[test]
    fn a_shard_is_handed_out_once_until_its_action_is_posted() {
        let mut r = two_by_two();
        assert_eq!(r.stepping().collect::<Vec<_>>(), [(0, 5), (1, 5)]);
        assert_eq!(r.hand_out(1).unwrap(), 2..4);
        assert!(matches!(r.hand_out(1), Err(Error::OutOfOrder(_))));
        assert_eq!(r.stepping().collect::<Vec<_>>(), [(0, 5)]);
        assert_eq!(r.check_send(&[3, 2]).unwrap(), [1]);
        assert_eq!(r.post(1).unwrap(), 6);
        assert!(matches!(r.post(1), Err(Error::OutOfOrder(_))));
        assert_eq!(r.stepping().collect::<Vec<_>>(), [(0, 5), (1, 6)]);
    }

    #[test]
    fn the_order_of_sends_is_kept_across_shards_whose_frame_numbers_differ() {
        let mut r = two_by_two();
        assert_eq!((r.sent(0), r.sent(1)), (0, 0), "a reset posts all at once");
        r.hand_out(0).unwrap();
        r.hand_out(1).unwrap();
        r.post(0).unwrap();
        r.hand_out(0).unwrap();
        r.post(0).unwrap();
        // Shard 0 owes frame 7, shard 1 (posted after it) frame 6: shard 0 went first.
        r.post(1).unwrap();
        assert_eq!(r.stepping().collect::<Vec<_>>(), [(0, 7), (1, 6)]);
        assert!(r.sent(0) < r.sent(1));
    }

    #[test]
    fn a_send_lists_whole_held_shards_each_env_once() {
        let mut r = two_by_two();
        r.hand_out(0).unwrap();
        let not_in = |e: Result<Vec<usize>>| match e {
            Err(Error::NotInBatch { env_id, .. }) => env_id,
            other => panic!("{other:?}"),
        };
        assert_eq!(not_in(r.check_send(&[0, 1, 2])), 2, "shard 1 not received");
        assert_eq!(not_in(r.check_send(&[0, 0])), 0, "twice");
        assert_eq!(not_in(r.check_send(&[1])), 0, "half a shard");
        assert_eq!(not_in(r.check_send(&[9])), 9, "out of range");
        // A refused send changed nothing: the whole shard is still accepted.
        assert_eq!(r.check_send(&[1, 0]).unwrap(), [0]);
        assert_eq!(r.check_send(&[]).unwrap(), Vec::<usize>::new());
    }
}
