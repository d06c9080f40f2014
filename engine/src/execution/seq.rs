//! Sequence parallelism within one group of ranks ([`layerwise_core::topology`]): the
//! exchanges a request's tasks make across the group's members while its blocks run, and
//! [`Split`], what one member's task holds of its request.
//!
//! Every exchange first meets at a host-side rendezvous keyed by the request and the
//! exchange's index within it ([`Rendezvous`]). That is what keeps a request's failure a
//! request's failure: a member whose request fails marks it aborted, and its peers' pending
//! and later exchanges for that request fail at once with that member's error instead of
//! waiting for it (on a GPU, before any of them enqueues a collective, so the collectives
//! stay matched and nothing hangs). A member that stops arriving altogether (a dead rank)
//! fails the others after the run's timeout, as the pass coordinator does. On the CPU the
//! rendezvous also carries the data; on CUDA the members then run NCCL sends and receives.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use layerwise_core::topology;

use super::work::WorkKey;
use crate::error::Abandoned;
use crate::{Error, Result};

/// Aborted requests remembered, for members that reach an exchange of one late.
const ABORTED_KEPT: usize = 64;

/// The exchanges of one group's members.
pub trait SeqExchange: Send + Sync {
    /// Members in the group.
    fn size(&self) -> usize;
    /// Exchange `index` of request `key` from member `member`: `parts[q]` goes to member
    /// q (its own part included); returns what every member sent this one, in member
    /// order, shaped as `recv` says (the callers' agreement, checked where it can be).
    fn all_to_all(
        &self,
        key: WorkKey,
        index: u64,
        member: usize,
        parts: Vec<Tensor>,
        recv: &[Vec<usize>],
    ) -> Result<Vec<Tensor>>;
    /// Member `member`'s request `key` failed with `why`: its peers' exchanges for it fail.
    fn abort(&self, key: WorkKey, member: usize, why: &str);
    /// A rank of the run died: every exchange fails from now on, quoting `why`.
    fn poison(&self, why: String);
}

/// The host-side meeting point of one group: each exchange of each request is a slot the
/// members post to and take from.
pub struct Rendezvous {
    size: usize,
    timeout: Duration,
    state: Mutex<Meet>,
    cv: Condvar,
}

#[derive(Default)]
struct Meet {
    /// Open exchanges by (request, index): each member's posted parts (taken by their
    /// addressees) and how many members have taken theirs.
    slots: BTreeMap<(WorkKey, u64), Slot>,
    aborted: VecDeque<(WorkKey, String)>,
    poisoned: Option<String>,
}

struct Slot {
    posted: Vec<Option<Vec<Option<Tensor>>>>,
    taken: usize,
}

impl Rendezvous {
    pub fn new(size: usize, timeout: Duration) -> Arc<Rendezvous> {
        Arc::new(Rendezvous {
            size,
            timeout,
            state: Mutex::new(Meet::default()),
            cv: Condvar::new(),
        })
    }

    /// Posts member `member`'s `parts` (one per member, or none when only meeting) to
    /// exchange `index` of `key`, waits for every member's, and returns the parts addressed
    /// to `member`, in member order.
    pub fn meet(
        &self,
        key: WorkKey,
        index: u64,
        member: usize,
        parts: Option<Vec<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut s = self.state.lock().expect("rendezvous lock");
        let failed = |s: &Meet| -> Option<Error> {
            if let Some(p) = &s.poisoned {
                return Some(Error::Abandoned(Abandoned {
                    rank: member,
                    what: "sequence-parallel exchange",
                    cause: p.clone(),
                }));
            }
            s.aborted
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, why)| Error::Conflict {
                    what: format!(
                        "request {} failed on another rank of its group: {why}",
                        key.id
                    ),
                })
        };
        if let Some(e) = failed(&s) {
            return Err(e);
        }
        let size = self.size;
        let slot = s.slots.entry((key, index)).or_insert_with(|| Slot {
            posted: vec![None; size],
            taken: 0,
        });
        if slot.posted[member].is_some() {
            return Err(Error::bug(format!(
                "sequence-parallel exchange {index} of request {key}: member {member} arrived twice"
            )));
        }
        slot.posted[member] = Some(match parts {
            Some(p) => p.into_iter().map(Some).collect(),
            None => vec![None; size],
        });
        self.cv.notify_all();
        let start = Instant::now();
        loop {
            if let Some(e) = failed(&s) {
                return Err(e);
            }
            let slot = s
                .slots
                .get_mut(&(key, index))
                .expect("slot stays until taken");
            if slot.posted.iter().all(Option::is_some) {
                let mine: Vec<Option<Tensor>> = slot
                    .posted
                    .iter_mut()
                    .map(|p| p.as_mut().and_then(|p| p.get_mut(member)?.take()))
                    .collect();
                slot.taken += 1;
                if slot.taken == size {
                    s.slots.remove(&(key, index));
                }
                return Ok(mine);
            }
            let left = self.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let missing: Vec<usize> = (0..size).filter(|&q| slot.posted[q].is_none()).collect();
                let why = format!(
                    "member {member} waited {:?} at sequence-parallel exchange {index} of request {key} (members not arrived: {missing:?})",
                    self.timeout
                );
                s.poisoned = Some(why.clone());
                self.cv.notify_all();
                return Err(Error::Rank {
                    rank: member,
                    msg: why,
                });
            }
            s = self.cv.wait_timeout(s, left).expect("rendezvous lock").0;
        }
    }

    /// Marks `key` aborted by `member` (see [`SeqExchange::abort`]) and drops its open
    /// exchanges.
    pub fn abort(&self, key: WorkKey, member: usize, why: &str) {
        let mut s = self.state.lock().expect("rendezvous lock");
        if !s.aborted.iter().any(|(k, _)| *k == key) {
            if s.aborted.len() == ABORTED_KEPT {
                s.aborted.pop_front();
            }
            s.aborted
                .push_back((key, format!("member {member}: {why}")));
        }
        s.slots.retain(|(k, _), _| *k != key);
        self.cv.notify_all();
    }

    pub fn poison(&self, why: String) {
        let mut s = self.state.lock().expect("rendezvous lock");
        s.poisoned.get_or_insert(why);
        self.cv.notify_all();
    }

    pub fn size(&self) -> usize {
        self.size
    }
}

/// The CPU backend's exchange: the parts move through the rendezvous itself (device
/// memory is host memory, so a part is handed over, not copied).
pub struct LocalExchange(pub Arc<Rendezvous>);

impl SeqExchange for LocalExchange {
    fn size(&self) -> usize {
        self.0.size()
    }

    fn all_to_all(
        &self,
        key: WorkKey,
        index: u64,
        member: usize,
        parts: Vec<Tensor>,
        recv: &[Vec<usize>],
    ) -> Result<Vec<Tensor>> {
        check_parts(self.size(), &parts, recv)?;
        let got = self.0.meet(key, index, member, Some(parts))?;
        got.into_iter()
            .zip(recv)
            .enumerate()
            .map(|(q, (t, shape))| {
                let t = t.ok_or_else(|| {
                    Error::bug(format!("sequence-parallel exchange {index}: member {q} sent nothing"))
                })?;
                if t.dims() != shape.as_slice() {
                    return Err(Error::bug(format!(
                        "sequence-parallel exchange {index} of request {key}: member {q} sent {:?} to member {member}, which expected {shape:?}",
                        t.dims()
                    )));
                }
                Ok(t)
            })
            .collect()
    }

    fn abort(&self, key: WorkKey, member: usize, why: &str) {
        self.0.abort(key, member, why)
    }

    fn poison(&self, why: String) {
        self.0.poison(why)
    }
}

/// One part per member and one expected shape per member.
pub fn check_parts(size: usize, parts: &[Tensor], recv: &[Vec<usize>]) -> Result<()> {
    if parts.len() != size || recv.len() != size {
        return Err(Error::bug(format!(
            "sequence-parallel exchange: {} parts and {} shapes for {size} members",
            parts.len(),
            recv.len()
        )));
    }
    Ok(())
}

/// What one member's task holds of its request's group: which share of the sequence it
/// computes, and the exchanges that give it the rest. `Split::whole()` is a group of one,
/// whose exchanges are the identity.
pub struct Split {
    member: usize,
    size: usize,
    link: Option<(Arc<dyn SeqExchange>, WorkKey)>,
    /// Exchanges made so far for this request (each has its index).
    made: u64,
}

impl Split {
    /// The whole sequence on one rank.
    pub fn whole() -> Split {
        Split {
            member: 0,
            size: 1,
            link: None,
            made: 0,
        }
    }

    /// Member `member` of a group exchanging through `exchange`, for request `key`.
    pub fn member(exchange: Arc<dyn SeqExchange>, member: usize, key: WorkKey) -> Split {
        let size = exchange.size();
        Split {
            member,
            size,
            link: (size > 1).then_some((exchange, key)),
            made: 0,
        }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn index(&self) -> usize {
        self.member
    }

    /// This member's share of `n` items ([`topology::split`]).
    pub fn share(&self, n: usize) -> Range<usize> {
        topology::split(n, self.size, self.member)
    }

    /// Marks the request failed on this member, so its peers stop waiting for it.
    pub fn abort(&self, why: &str) {
        if let Some((x, key)) = &self.link {
            x.abort(*key, self.member, why);
        }
    }

    fn exchange(&mut self, parts: Vec<Tensor>, recv: &[Vec<usize>]) -> Result<Vec<Tensor>> {
        let Some((x, key)) = &self.link else {
            return Ok(parts);
        };
        let index = self.made;
        self.made += 1;
        x.all_to_all(*key, index, self.member, parts, recv)
    }

    /// Ulysses' first all-to-all: `x` [B, H, s, D] holds every head of this member's
    /// share of `tokens` tokens; returns [B, h, tokens, D], this member's share of the
    /// heads for every token. Heads move in units of `unit` heads (a key/value head's
    /// query heads stay together), split as [`Self::share`] splits `H / unit` units.
    pub fn to_heads(&mut self, x: &Tensor, tokens: usize, unit: usize) -> Result<Tensor> {
        let (units, size) = (x.dim(1)? / unit.max(1), self.size);
        let heads = |q: usize| {
            let r = topology::split(units, size, q);
            r.start * unit..r.end * unit
        };
        let mine = heads(self.member).len();
        let share = |q| topology::split(tokens, size, q).len();
        self.redistribute(x, (1, &heads), (2, &|q| (mine, share(q))))
    }

    /// Ulysses' second all-to-all, the inverse of [`Self::to_heads`]: `o` [B, h, tokens,
    /// D] of this member's heads back to [B, H, s, D], every head of its tokens.
    pub fn to_tokens(&mut self, o: &Tensor, heads: usize, unit: usize) -> Result<Tensor> {
        let (units, size) = (heads / unit.max(1), self.size);
        let tokens = o.dim(2)?;
        let mine = self.share(tokens).len();
        self.redistribute(
            o,
            (2, &|q| topology::split(tokens, size, q)),
            (1, &|q| (topology::split(units, size, q).len() * unit, mine)),
        )
    }

    /// One all-to-all of a [B, heads, tokens, D] tensor: member q gets the slice
    /// `send.1(q)` of dimension `send.0`, and what member q sends this one, of (heads,
    /// tokens) `recv.1(q)`, is concatenated along dimension `recv.0`.
    #[allow(clippy::type_complexity)]
    fn redistribute(
        &mut self,
        x: &Tensor,
        send: (usize, &dyn Fn(usize) -> Range<usize>),
        recv: (usize, &dyn Fn(usize) -> (usize, usize)),
    ) -> Result<Tensor> {
        if self.size == 1 {
            return Ok(x.clone());
        }
        let (b, _, _, d) = x.dims4()?;
        let parts = (0..self.size)
            .map(|q| {
                let r = send.1(q);
                Ok(x.narrow(send.0, r.start, r.len())?.contiguous()?)
            })
            .collect::<Result<Vec<_>>>()?;
        let shapes: Vec<Vec<usize>> = (0..self.size)
            .map(|q| {
                let (h, t) = recv.1(q);
                vec![b, h, t, d]
            })
            .collect();
        let got = self.exchange(parts, &shapes)?;
        Ok(Tensor::cat(&got, recv.0)?)
    }

    /// Every member's share of a sequence along `dim` of `x` (this member's share of
    /// `tokens`), in order: the whole sequence on every member.
    pub fn gather(&mut self, x: &Tensor, dim: usize, tokens: usize) -> Result<Tensor> {
        if self.size == 1 {
            return Ok(x.clone());
        }
        let x = x.contiguous()?;
        let parts = vec![x.clone(); self.size];
        let recv: Vec<Vec<usize>> = (0..self.size)
            .map(|q| {
                let mut s = x.dims().to_vec();
                s[dim] = topology::split(tokens, self.size, q).len();
                s
            })
            .collect();
        let got = self.exchange(parts, &recv)?;
        Ok(Tensor::cat(&got, dim)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn key(id: u64) -> WorkKey {
        WorkKey { id, index: 0 }
    }

    /// Runs `f(split)` on `size` member threads of one group and returns their results.
    fn on_members<T: Send>(size: usize, f: impl Fn(Split) -> Result<T> + Sync) -> Vec<Result<T>> {
        let meet = Rendezvous::new(size, Duration::from_secs(5));
        let x: Arc<dyn SeqExchange> = Arc::new(LocalExchange(meet));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..size)
                .map(|m| {
                    let (x, f) = (x.clone(), &f);
                    s.spawn(move || f(Split::member(x, m, key(1))))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn heads_and_tokens_round_trip_for_uneven_splits() {
        let (b, h, n, d) = (2, 8, 7, 3);
        let full = Tensor::arange(0f32, (b * h * n * d) as f32, &Device::Cpu)
            .unwrap()
            .reshape((b, h, n, d))
            .unwrap();
        for size in 1..=4 {
            for unit in [1, 2] {
                let out = on_members(size, |mut sp| {
                    let r = sp.share(n);
                    let mine = full.narrow(2, r.start, r.len())?;
                    let by_heads = sp.to_heads(&mine, n, unit)?;
                    // Member m holds every token of its heads, exactly as the whole has them.
                    let hr = sp.share(h / unit);
                    let want = full.narrow(1, hr.start * unit, hr.len() * unit)?;
                    assert_eq!(
                        by_heads.flatten_all()?.to_vec1::<f32>()?,
                        want.flatten_all()?.to_vec1::<f32>()?
                    );
                    let back = sp.to_tokens(&by_heads, h, unit)?;
                    assert_eq!(
                        back.flatten_all()?.to_vec1::<f32>()?,
                        mine.flatten_all()?.to_vec1::<f32>()?
                    );
                    let whole = sp.gather(&mine, 2, n)?;
                    Ok(whole.flatten_all()?.to_vec1::<f32>()?)
                });
                let want = full.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for o in out {
                    assert_eq!(o.unwrap(), want, "size {size} unit {unit}");
                }
            }
        }
    }

    #[test]
    fn a_members_failure_fails_its_peers_exchange_not_the_group() {
        let out = on_members(3, |mut sp| {
            let t = Tensor::zeros((1, 3, 1, 1), candle_core::DType::F32, &Device::Cpu)?;
            if sp.index() == 1 {
                sp.abort("out of device memory in block 4");
                return Ok(String::new());
            }
            Ok(sp.to_heads(&t, 3, 1).unwrap_err().to_string())
        });
        for (m, o) in out.into_iter().enumerate() {
            let o = o.unwrap();
            if m != 1 {
                assert!(
                    o.contains("request 1 failed on another rank") && o.contains("block 4"),
                    "{o}"
                );
            }
        }
        // A missing member (a dead rank) fails the wait after the timeout, naming it.
        let meet = Rendezvous::new(2, Duration::from_millis(50));
        let e = meet.meet(key(2), 0, 0, None).unwrap_err().to_string();
        assert!(e.contains("members not arrived: [1]"), "{e}");
        let e = meet.meet(key(3), 0, 1, None).unwrap_err().to_string();
        assert!(e.contains("members not arrived"), "{e}");
    }
}
