//! The search: of the options [`super::candidates`] offers for one sp, the one a plan keeps.
//! Each option is checked against each node's memory and accelerators; on each node the
//! first that fits in the planner's order of preference is taken, its components, slots and
//! blocks kept chosen by the step-time model's predicted request time where it streams;
//! the best over the nodes wins. It returns what it kept and what it tried as data
//! ([`Account`]), which [`super::explain`] puts into words.

use std::collections::BTreeMap;

use crds::{Profile, Strategy, StrategyChoice, Workload};
use layerwise_core::memory::{self, Placement};
use layerwise_core::timing::{self, Choice};

use super::candidates::{options_for, rank, residency_candidates, sites, Option_, Site};
use super::inputs::{Candidate, Limits, Overrides};
use super::need::{device_total, need, Need};
use super::record::{Account, Alternative, ComponentVerdict, KeptBlocks, Miss, Slots, Streaming};
use super::refusal::{Refusal, Shortage};

/// What a search of one sp found: the record of the option kept, the profile of the node
/// it was chosen on, its predicted latency and step, and whether every node it fits
/// all-gathers over a fast peer link.
pub(super) struct Found<'a> {
    pub account: Account,
    pub profile: &'a Profile,
    pub latency: f64,
    pub step: f64,
    pub fast_peer_link: bool,
}

/// The best option of `candidates` with groups of `sp` ranks, the pods decoding where
/// `limits` says; or the refusal of the option that came closest.
pub(super) fn search<'a>(
    candidates: &'a [Candidate],
    workload: &Workload,
    overrides: &Overrides,
    sp: u32,
    limits: &Limits,
) -> Result<Found<'a>, Refusal> {
    if candidates.is_empty() {
        return Err(Refusal {
            shortage: Shortage::NoNodes,
            node: None,
            needed: 1,
            available: 0,
            option: "no node matches the node selector, offers the accelerator and has reported a profile".into(),
        });
    }
    let sites = sites(candidates, workload, sp, limits)?;
    let search = Search::new(overrides, limits);
    let mut misses: Vec<Miss> = Vec::new();
    let Some(best) = search.best(&sites, sp, &mut misses) else {
        return Err(
            Refusal::furthest(misses.iter().map(Miss::refusal)).unwrap_or_else(|| {
                Refusal::invalid(
                    "no strategy applies to these nodes with the fixed settings".into(),
                )
            }),
        );
    };
    let site = &sites[best.site];
    let (profile, predicted) = (site.profile, site.prediction(&best.option));
    let chosen = Chosen::new(&sites, best.option, best.site, limits);
    let fast_peer_link = chosen.fits.iter().all(|(site, _)| site.node.fast_peer_link);
    let account = search.account(chosen, best.verdicts, best.timed, candidates.len(), misses);
    Ok(Found {
        account,
        profile,
        latency: predicted.request,
        step: predicted.step,
        fast_peer_link,
    })
}

/// Checks `opt` against `node`: Ok with its need, or the first resource that falls short.
fn check(site: &Site, opt: &Option_, limits: &Limits) -> Result<Need, Miss> {
    check_placement(site, opt, &opt.placement(site.profile), limits)
}

/// [`check`] of `opt` with its weights placed as `placement` says.
fn check_placement(
    site: &Site,
    opt: &Option_,
    placement: &Placement,
    limits: &Limits,
) -> Result<Need, Miss> {
    let (profile, node) = (site.profile, site.node);
    let miss = |shortage, needed, available| Miss {
        shortage,
        node: node.name.clone(),
        needed,
        available,
        option: opt.clone(),
    };
    if opt.ranks() > node.devices {
        return Err(miss(
            Shortage::Accelerators,
            u64::from(opt.ranks()),
            u64::from(node.devices),
        ));
    }
    let Some(act) = site.act(opt.sp) else {
        return Err(miss(Shortage::DeviceMemory, u64::MAX, node.device_bytes));
    };
    let n = need(profile, act, site.decoder, placement, limits);
    let dev = device_total(&n.device);
    if dev > node.device_bytes {
        return Err(miss(Shortage::DeviceMemory, dev, node.device_bytes));
    }
    let host = memory::node_host_bytes(n.host_shared, n.host_per_pod, 1);
    if host > node.host_bytes {
        return Err(miss(Shortage::HostMemory, host, node.host_bytes));
    }
    Ok(n)
}

/// How the planner ranks the options that fit on different nodes, the least first: the
/// preferred strategy, then the fewest ranks, then the least predicted request time.
fn preference(o: &Option_) -> (usize, u32) {
    (rank(o.strategy), o.dp)
}

/// The best option over every node, with the node it was found on, the verdicts on the
/// components it keeps or streams, and its predicted time where it streams.
struct Best {
    option: Option_,
    verdicts: Vec<ComponentVerdict>,
    timed: Option<Timed>,
    /// Its index among the sites.
    site: usize,
}

/// What the step-time model said of the chosen option: its prediction, and the request
/// time with one block fewer and one more of each component whose blocks it keeps.
#[derive(Debug, Clone)]
struct Timed {
    choice: Choice,
    /// Per component: (blocks, request seconds with one fewer, with one more where that
    /// fits).
    around: Vec<(String, u64, Option<f64>, Option<f64>)>,
}

/// What one planning pass holds fixed while it searches the options: the spec's settings,
/// the allowances, and the range K grows in.
struct Search<'a> {
    overrides: &'a Overrides,
    limits: &'a Limits,
    /// K to start from; the planner grows it with the memory left once components are
    /// placed.
    k_first: u32,
    /// The most slots K grows to.
    k_cap: u32,
}

impl<'a> Search<'a> {
    fn new(overrides: &'a Overrides, limits: &'a Limits) -> Search<'a> {
        let k_first = overrides.slots.unwrap_or(limits.min_slots.max(1));
        Search {
            overrides,
            limits,
            k_first,
            k_cap: limits.max_slots.max(k_first),
        }
    }

    /// The best of each node's first option with groups of `sp` ranks that fits, by
    /// [`preference`] and then the predicted request time; every miss on the way goes to
    /// `misses`.
    fn best(&self, sites: &[Site], sp: u32, misses: &mut Vec<Miss>) -> Option<Best> {
        let mut best: Option<Best> = None;
        for (si, site) in sites.iter().enumerate() {
            let Some((option, verdicts, timed)) = self.first_fit(site, sp, misses) else {
                continue;
            };
            let time = |t: &Option<Timed>| t.as_ref().map_or(0.0, |t| t.choice.prediction.request);
            let better = best.as_ref().is_none_or(|b| {
                (preference(&option), time(&timed)) < (preference(&b.option), time(&b.timed))
            });
            if better {
                best = Some(Best {
                    option,
                    verdicts,
                    timed,
                    site: si,
                });
            }
        }
        best
    }

    /// The first of [`options_for`] `site` that fits it, with the components, K and
    /// blocks kept chosen by predicted time where it streams ([`Self::by_time`]), and
    /// what was decided about each component; every miss goes to `misses`.
    fn first_fit(
        &self,
        site: &Site,
        sp: u32,
        misses: &mut Vec<Miss>,
    ) -> Option<(Option_, Vec<ComponentVerdict>, Option<Timed>)> {
        for (strategy, dp) in options_for(site.node, self.overrides, sp, self.limits) {
            let k = if strategy.streams() { self.k_first } else { 0 };
            let opt = Option_::new(strategy, dp, sp, k);
            if let Err(m) = check(site, &opt, self.limits) {
                misses.push(m);
                continue;
            }
            if !strategy.streams() {
                return Some((opt, Vec::new(), None));
            }
            let (opt, verdicts, timed) = self.by_time(site, opt);
            return Some((opt, verdicts, Some(timed)));
        }
        None
    }

    /// For `opt`'s strategy and dp: the components kept whole, K (unless the spec fixes
    /// it) and the blocks kept of each streamed component with the least predicted
    /// request time ([`timing::choose`]) among those that fit, ties within
    /// [`timing::TIE_TOLERANCE`] going to the fewest device bytes. The verdicts say why
    /// each candidate component is kept or streams.
    fn by_time(&self, site: &Site, opt: Option_) -> (Option_, Vec<ComponentVerdict>, Timed) {
        let profile = site.profile;
        let candidates = residency_candidates(profile);
        let ks: Vec<u32> = match self.overrides.slots {
            Some(k) => vec![k],
            None => (self.k_first..=self.k_cap).collect(),
        };
        // Every subset of the candidates (pipeline order, a handful at most) with every K.
        let subsets: Vec<Vec<String>> = (0u32..1 << candidates.len().min(4))
            .map(|mask| {
                candidates
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, c)| c.clone())
                    .collect()
            })
            .collect();
        let mut found: Vec<(Option_, Choice)> = Vec::new();
        let mut misses: BTreeMap<String, Miss> = BTreeMap::new();
        for resident in &subsets {
            for &k in &ks {
                let base = Option_ {
                    resident: resident.clone(),
                    k,
                    ..opt.clone()
                };
                let fits = |p: &Placement| {
                    check_placement(site, &base, p, self.limits)
                        .ok()
                        .map(|n| device_total(&n.device))
                };
                let placement = base.placement(profile);
                match timing::choose(
                    &profile.groups,
                    &site.compute,
                    &site.work(base.sp),
                    &placement,
                    &site.node.rates,
                    &fits,
                ) {
                    Some(choice) => {
                        let chosen = Option_ {
                            kept: choice.kept.clone(),
                            ..base
                        };
                        found.push((chosen, choice));
                    }
                    None => {
                        if let (Err(m), [c]) = (check(site, &base, self.limits), &resident[..]) {
                            misses.entry(c.clone()).or_insert(m);
                        }
                    }
                }
            }
        }
        let picked = timing::pick(found.iter().map(|(_, c)| c.clone()))
            .expect("the option fits with nothing kept");
        let (chosen, choice) = found
            .iter()
            .find(|(_, c)| *c == picked)
            .cloned()
            .expect("picked among them");
        let verdicts = candidates
            .iter()
            .map(|c| verdict(c, &chosen, &choice, &found, misses.get(c)))
            .collect();
        let around = self.around(site, &chosen);
        (chosen, verdicts, Timed { choice, around })
    }

    /// Per component whose blocks `chosen` keeps: the predicted request time with one
    /// block fewer, and with one more where that fits.
    fn around(
        &self,
        site: &Site,
        chosen: &Option_,
    ) -> Vec<(String, u64, Option<f64>, Option<f64>)> {
        let time = |o: &Option_| site.latency(o);
        chosen
            .kept
            .iter()
            .map(|(c, &n)| {
                let with = |m: u64| {
                    let mut o = chosen.clone();
                    o.kept.insert(c.clone(), m);
                    o
                };
                let fewer = (n > 0).then(|| time(&with(n - 1)));
                let more = with(n + 1);
                let more = (more.placement(site.profile).streams(&site.profile.groups)
                    && check(site, &more, self.limits).is_ok())
                .then(|| time(&more));
                (c.clone(), n, fewer, more)
            })
            .collect()
    }

    /// The record of `chosen` (with the `verdicts` on its components and its prediction
    /// `timed` where it streams) among `candidates` nodes, and the `misses` on the way.
    fn account(
        &self,
        chosen: Chosen,
        verdicts: Vec<ComponentVerdict>,
        timed: Option<Timed>,
        candidates: usize,
        misses: Vec<Miss>,
    ) -> Account {
        let o = &chosen.option;
        let overrides = self.overrides;
        let mut copies: Vec<(u64, String)> = chosen
            .fits
            .iter()
            .map(|(site, _)| (site.profile.total_bytes, site.node.name.clone()))
            .collect();
        copies.sort();
        copies.dedup_by_key(|(b, _)| *b);
        let streaming = timed.map(|t| Streaming {
            rates: chosen.site.node.rates,
            rates_from: chosen.site.node.rates_from.clone(),
            work: chosen.site.work(o.sp),
            sp: o.sp,
            components: verdicts,
            kept: t
                .around
                .iter()
                .map(|(c, n, fewer, more)| KeptBlocks {
                    component: c.clone(),
                    kept: *n,
                    blocks: chosen
                        .profile
                        .groups
                        .iter()
                        .filter(|g| g.component == *c)
                        .map(|g| g.blocks())
                        .max()
                        .unwrap_or(0),
                    request: t.choice.prediction.request,
                    fewer: *fewer,
                    more: *more,
                })
                .collect(),
            prediction: t.choice.prediction,
        });
        Account {
            need: chosen.need.clone(),
            decode: self.limits.decode,
            copies,
            largest: chosen.largest.node.name.clone(),
            fewer_groups_fit: self.fewer_groups_fit(&chosen),
            rates_from: chosen.site.node.rates_from.clone(),
            streaming,
            slots: (o.strategy.streams() && overrides.slots.is_none()).then_some(Slots {
                k: o.k,
                min: self.limits.min_slots,
                cap: self.limits.max_slots,
            }),
            fits: chosen
                .fits
                .iter()
                .map(|(site, _)| site.node.name.clone())
                .collect(),
            candidates,
            fixed: overrides.strategy != StrategyChoice::Auto
                || overrides.dp.is_some()
                || overrides.sp.is_some()
                || overrides.slots.is_some(),
            misses,
            device_decode_refused: None,
            option: chosen.option,
        }
    }

    /// For a `sharded` option whose dp the spec leaves to the planner: the fewest groups
    /// that would fit every node it fits too (its dp is the one that divides the nodes'
    /// accelerators).
    fn fewer_groups_fit(&self, chosen: &Chosen) -> Option<u32> {
        let o = &chosen.option;
        if o.strategy != Strategy::Sharded || self.overrides.dp.is_some() {
            return None;
        }
        let least = if o.sp >= 2 { 1 } else { 2 };
        (least..o.dp).find(|&dp| {
            let fewer = Option_::new(o.strategy, dp, o.sp, self.k_first);
            chosen
                .fits
                .iter()
                .any(|(site, _)| check(site, &fewer, self.limits).is_ok())
        })
    }
}

/// The chosen option and the nodes it fits, each sized with its own profile. The plan holds
/// the most any of them needs (they differ only if their agents report different copies of
/// the model).
struct Chosen<'s, 'a> {
    option: Option_,
    /// The profile of the node the option was chosen on.
    profile: &'a Profile,
    /// The node the option was chosen on.
    site: &'s Site<'a>,
    /// Every node the option fits, with what it needs there.
    fits: Vec<(&'s Site<'a>, Need)>,
    /// The node that needs the most, and its need: the plan's figures.
    largest: &'s Site<'a>,
    need: Need,
}

impl<'s, 'a> Chosen<'s, 'a> {
    /// `option`, chosen on `sites[site]`, over every one of `sites` it fits.
    fn new(sites: &'s [Site<'a>], option: Option_, site: usize, limits: &Limits) -> Self {
        let fits: Vec<(&Site, Need)> = sites
            .iter()
            .filter_map(|site| check(site, &option, limits).ok().map(|n| (site, n)))
            .collect();
        let (largest, need) = fits
            .iter()
            .max_by_key(|(_, n)| (device_total(&n.device), n.host_per_pod, n.host_shared))
            .map(|(site, n)| (*site, n.clone()))
            .expect("the chosen option fits its own node");
        Chosen {
            option,
            profile: sites[site].profile,
            site: &sites[site],
            fits,
            largest,
            need,
        }
    }
}

/// Why `c` stays whole or streams under `chosen` (predicted as `choice`): the best of
/// `found` that does the other, or what keeping it whole would need (`miss`).
fn verdict(
    c: &str,
    chosen: &Option_,
    choice: &Choice,
    found: &[(Option_, Choice)],
    miss: Option<&Miss>,
) -> ComponentVerdict {
    let whole = chosen.resident.iter().any(|r| r == c);
    let other = timing::pick(
        found
            .iter()
            .filter(|(o, _)| o.resident.iter().any(|r| r == c) != whole)
            .map(|(_, ch)| ch.clone()),
    );
    ComponentVerdict {
        component: c.to_string(),
        whole,
        request: choice.prediction.request,
        other: other.map(|o| Alternative {
            request: o.prediction.request,
            extra_device_bytes: o.device_bytes.saturating_sub(choice.device_bytes),
        }),
        short: miss.map(|m| (m.needed, m.available)),
    }
}
