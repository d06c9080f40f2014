//! A request's step cache on a server: the server's setting (`serve --cache`, a
//! DiffusionDeployment's `workload.cache`) is each request's default and its bound. The
//! bound is what the plan was sized for: the device memory reserved for the setting's
//! cached tensors, and the quality its operator chose. So a request may turn the cache
//! off, or take the server's kind with parameters that skip no more and hold no more
//! than the server's ([`StepCache::within`]); anything else is a 422 naming the field.

use serde_json::Value;

use super::config::{CacheKind, StepCache};
use crate::{Error, Result};

/// The value a request gives to turn the cache off.
pub const OFF: &str = "off";

/// What a request's `field` (its JSON value, or a form's text) asks of the step cache on a
/// server set to `server`: `None` when it runs uncached. Absent or `null`: the server's
/// setting. `"off"` (or `{"kind": "off"}`): no cache. A kind's name, or an object with
/// `kind` and some parameters (as JSON, or a form's text holding JSON): that kind, its
/// parameters the request's where given and the server's elsewhere, within the server's.
pub fn request_setting(
    field: &str,
    server: Option<&StepCache>,
    given: Option<&Value>,
) -> Result<Option<StepCache>> {
    let given = match given {
        None | Some(Value::Null) => return Ok(server.cloned()),
        Some(Value::String(s)) => text_value(s),
        Some(v) => v.clone(),
    };
    let kind = match &given {
        Value::String(s) => Some(s.as_str()),
        Value::Object(o) => o.get("kind").and_then(Value::as_str),
        _ => None,
    };
    if kind == Some(OFF) {
        return Ok(None);
    }
    let Some(server) = server else {
        return Err(Error::invalid(
            field,
            "this server runs no step cache (its --cache, a deployment's workload.cache, is \
             unset), so no request may ask for one; give \"off\" or leave the field out",
        ));
    };
    let asked = match &given {
        // A kind's name alone: the server's parameters when it is the server's kind.
        Value::String(s) if s == server.kind().name() => server.clone(),
        Value::String(s) => StepCache::parse(field, s)?,
        Value::Object(o) => {
            let mut merged = serde_json::to_value(server)
                .map_err(|e| Error::internal("the server's cache setting as JSON", e))?;
            if o.get("kind") == merged.get("kind") {
                if let Value::Object(m) = &mut merged {
                    m.extend(o.clone());
                }
            } else {
                merged = given.clone();
            }
            StepCache::parse(field, &merged.to_string())?
        }
        other => {
            return Err(Error::invalid(
                field,
                format!(
                    "{other}: expected \"off\", a cache kind ({}) or an object with `kind`",
                    super::kinds()
                ),
            ))
        }
    };
    asked.within(field, server)?;
    Ok(Some(asked))
}

/// Refuses a server's setting (`serve --cache`, named `flag`) before the model serves
/// anything: one its family (`name`, offering `honoured`) cannot honour, a calibration
/// (it records ratios and skips nothing, a job for `generate`), and a decision that reads
/// the whole sequence on a server whose requests split it over `sp` ranks.
pub fn check_server(
    flag: &str,
    cfg: &StepCache,
    name: &str,
    honoured: &[CacheKind],
    sp: usize,
) -> Result<()> {
    super::check::check_setting(flag, name, honoured, cfg)?;
    if let StepCache::Mag {
        calibrate: true, ..
    } = cfg
    {
        return Err(Error::invalid(
            flag,
            "MagCache without ratios calibrates: it runs every step to record the model's \
             ratios; record them once with `layerwise generate --cache mag` and serve with \
             {\"kind\":\"mag\",\"ratios\":[..]}",
        ));
    }
    if cfg.reads_whole_sequence() && sp > 1 {
        return Err(Error::invalid(
            flag,
            format!(
                "`{}` reads the whole sequence at every step, and --sp {sp} splits it over \
                 ranks; serve it with --sp 1 or choose `mag` or `taylorseer`",
                cfg.kind()
            ),
        ));
    }
    Ok(())
}

/// A form's text: JSON when it reads as an object, else the name it is.
fn text_value(s: &str) -> Value {
    match serde_json::from_str::<Value>(s.trim()) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::String(s.trim().to_string()),
    }
}

impl StepCache {
    /// Refuses a setting beyond `server`'s, naming `field.parameter`: another kind, or a
    /// parameter that would skip more steps (a higher threshold, more skips in a row, a
    /// smaller retention, a longer interval, an earlier start or a later end of
    /// TaylorSeer's skipping) or hold more (a higher Taylor order), or MagCache's ratios
    /// other than the server's (they are the model's, calibrated once).
    pub fn within(&self, field: &str, server: &StepCache) -> Result<()> {
        let over = |p: &str, asked: String, allowed: String, what: &str| {
            Err(Error::invalid(
                format!("{field}.{p}"),
                format!("{asked}: this server allows {allowed} ({what})"),
            ))
        };
        use StepCache as C;
        match (self, server) {
            (C::FirstBlock { threshold: a }, C::FirstBlock { threshold: s }) if a > s => over(
                "threshold",
                a.to_string(),
                format!("at most {s}"),
                "its setting",
            ),
            (C::FirstBlock { .. }, C::FirstBlock { .. }) => Ok(()),
            (
                C::Sea {
                    threshold,
                    residual_order,
                    retention_steps,
                    cache_end_steps,
                    max_consecutive_cached,
                    power_exp,
                },
                C::Sea {
                    threshold: st,
                    residual_order: so,
                    retention_steps: sr,
                    cache_end_steps: se,
                    max_consecutive_cached: sm,
                    power_exp: sp,
                },
            ) => {
                let setting = "its setting";
                if threshold > st {
                    return over(
                        "threshold",
                        threshold.to_string(),
                        format!("at most {st}"),
                        setting,
                    );
                }
                if retention_steps < sr {
                    return over(
                        "retention_steps",
                        retention_steps.to_string(),
                        format!("at least {sr}"),
                        setting,
                    );
                }
                if cache_end_steps < se {
                    return over(
                        "cache_end_steps",
                        cache_end_steps.to_string(),
                        format!("at least {se}"),
                        setting,
                    );
                }
                // 0 is no limit: the most skipping there is.
                if *sm != 0 && (*max_consecutive_cached == 0 || max_consecutive_cached > sm) {
                    return over(
                        "max_consecutive_cached",
                        max_consecutive_cached.to_string(),
                        format!("1 to {sm}"),
                        setting,
                    );
                }
                if residual_order > so {
                    return over(
                        "residual_order",
                        residual_order.to_string(),
                        format!("at most {so}"),
                        "the memory its plan reserved for the kept residuals",
                    );
                }
                if power_exp != sp {
                    return over(
                        "power_exp",
                        power_exp.to_string(),
                        format!("only {sp}"),
                        "the indicator its threshold was chosen for",
                    );
                }
                Ok(())
            }
            (
                C::Mag {
                    threshold,
                    max_skip_steps,
                    retention_ratio,
                    ratios,
                    calibrate,
                },
                C::Mag {
                    threshold: st,
                    max_skip_steps: sm,
                    retention_ratio: sr,
                    ratios: sratios,
                    ..
                },
            ) => {
                if threshold > st {
                    return over(
                        "threshold",
                        threshold.to_string(),
                        format!("at most {st}"),
                        "its setting",
                    );
                }
                if max_skip_steps > sm {
                    return over(
                        "max_skip_steps",
                        max_skip_steps.to_string(),
                        format!("at most {sm}"),
                        "its setting",
                    );
                }
                if retention_ratio < sr {
                    return over(
                        "retention_ratio",
                        retention_ratio.to_string(),
                        format!("at least {sr}"),
                        "its setting",
                    );
                }
                if *calibrate {
                    return Err(Error::invalid(
                        format!("{field}.calibrate"),
                        "a calibration records a model's ratios and skips nothing; run it with \
                         `layerwise generate --cache mag`, not through a server",
                    ));
                }
                if ratios != sratios {
                    return Err(Error::invalid(
                        format!("{field}.ratios"),
                        "a server runs MagCache with the model's ratios it was given; leave \
                         `ratios` out",
                    ));
                }
                Ok(())
            }
            (
                C::Taylorseer {
                    cache_interval,
                    disable_cache_before_step,
                    disable_cache_after_step,
                    max_order,
                },
                C::Taylorseer {
                    cache_interval: si,
                    disable_cache_before_step: sb,
                    disable_cache_after_step: sa,
                    max_order: so,
                },
            ) => {
                if cache_interval > si {
                    return over(
                        "cache_interval",
                        cache_interval.to_string(),
                        format!("at most {si}"),
                        "its setting",
                    );
                }
                if disable_cache_before_step < sb {
                    return over(
                        "disable_cache_before_step",
                        disable_cache_before_step.to_string(),
                        format!("at least {sb}"),
                        "its setting",
                    );
                }
                if let Some(sa) = sa {
                    if disable_cache_after_step.is_none_or(|a| a > *sa) {
                        let asked =
                            disable_cache_after_step.map_or("none".into(), |a| a.to_string());
                        return over(
                            "disable_cache_after_step",
                            asked,
                            format!("at most {sa}"),
                            "its setting",
                        );
                    }
                }
                if max_order > so {
                    return over(
                        "max_order",
                        max_order.to_string(),
                        format!("at most {so}"),
                        "the memory its plan reserved for the cached derivatives",
                    );
                }
                Ok(())
            }
            (asked, server) => Err(Error::invalid(
                format!("{field}.kind"),
                format!(
                    "`{}`: this server runs `{}` (its setting) and allows that kind or \"off\"",
                    asked.kind(),
                    server.kind()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fbc(t: f64) -> StepCache {
        StepCache::FirstBlock { threshold: t }
    }

    #[test]
    fn absent_takes_the_servers_and_off_turns_it_off() {
        let s = fbc(0.1);
        assert_eq!(
            request_setting("cache", Some(&s), None).unwrap(),
            Some(s.clone())
        );
        assert_eq!(
            request_setting("cache", Some(&s), Some(&Value::Null)).unwrap(),
            Some(s.clone())
        );
        for off in [
            json!("off"),
            json!({"kind": "off"}),
            json!("{\"kind\":\"off\"}"),
        ] {
            assert_eq!(
                request_setting("cache", Some(&s), Some(&off)).unwrap(),
                None
            );
            assert_eq!(request_setting("cache", None, Some(&off)).unwrap(), None);
        }
        // The kind's name alone: the server's parameters, not diffusers' defaults.
        assert_eq!(
            request_setting("cache", Some(&s), Some(&json!("first_block"))).unwrap(),
            Some(s.clone())
        );
        // Parameters given over the server's.
        let ts = StepCache::parse(
            "cache",
            r#"{"kind":"taylorseer","cache_interval":6,"max_order":2}"#,
        )
        .unwrap();
        let got = request_setting(
            "cache",
            Some(&ts),
            Some(&json!({"kind":"taylorseer","cache_interval":3})),
        )
        .unwrap();
        assert!(
            matches!(
                got,
                Some(StepCache::Taylorseer {
                    cache_interval: 3,
                    max_order: 2,
                    ..
                })
            ),
            "{got:?}"
        );
    }

    #[test]
    fn beyond_the_server_is_refused_naming_the_parameter() {
        let e = |server: Option<&StepCache>, v: Value| {
            request_setting("cache", server, Some(&v))
                .unwrap_err()
                .to_string()
        };
        let s = fbc(0.1);
        assert!(e(None, json!("first_block")).contains("runs no step cache"));
        assert!(
            e(Some(&s), json!({"kind":"first_block","threshold":0.2})).contains("cache.threshold")
        );
        assert!(e(Some(&s), json!("taylorseer")).contains("cache.kind"));
        assert!(
            e(Some(&s), json!({"kind":"first_block","threshold":-1})).contains("cache.threshold")
        );
        assert!(e(Some(&s), json!(3)).contains("cache"));
        let ts = StepCache::default_of(super::super::CacheKind::Taylorseer);
        assert!(
            e(Some(&ts), json!({"kind":"taylorseer","max_order":2})).contains("cache.max_order")
        );
        assert!(
            e(Some(&ts), json!({"kind":"taylorseer","cache_interval":9}))
                .contains("cache.cache_interval")
        );
        assert!(e(
            Some(&ts),
            json!({"kind":"taylorseer","disable_cache_before_step":1})
        )
        .contains("disable_cache_before_step"));
        let mag = StepCache::parse("c", r#"{"kind":"mag","ratios":[1.0,0.9]}"#).unwrap();
        assert!(e(Some(&mag), json!({"kind":"mag","ratios":[1.0]})).contains("cache.ratios"));
        assert!(
            e(Some(&mag), json!({"kind":"mag","retention_ratio":0.1})).contains("retention_ratio")
        );
        assert!(e(Some(&mag), json!({"kind":"mag","calibrate":true})).contains("cache.calibrate"));
        // Within: fewer skips are fine.
        assert!(request_setting(
            "cache",
            Some(&mag),
            Some(&json!({"kind":"mag","threshold":0.01}))
        )
        .is_ok());
        // SeaCache: each parameter that would skip more, hold more or read another
        // indicator is refused by name; fewer skips are fine.
        let sea = StepCache::default_of(super::super::CacheKind::Sea);
        for (v, p) in [
            (json!({"kind":"sea","threshold":0.5}), "cache.threshold"),
            (
                json!({"kind":"sea","retention_steps":0}),
                "cache.retention_steps",
            ),
            (
                json!({"kind":"sea","cache_end_steps":0}),
                "cache.cache_end_steps",
            ),
            (
                json!({"kind":"sea","max_consecutive_cached":0}),
                "cache.max_consecutive_cached",
            ),
            (
                json!({"kind":"sea","max_consecutive_cached":3}),
                "cache.max_consecutive_cached",
            ),
            (json!({"kind":"sea","power_exp":2.0}), "cache.power_exp"),
        ] {
            let msg = e(Some(&sea), v.clone());
            assert!(msg.contains(p), "{v}: {msg}");
        }
        let lower = StepCache::parse("c", r#"{"kind":"sea","residual_order":0}"#).unwrap();
        assert!(
            e(Some(&lower), json!({"kind":"sea","residual_order":1})).contains("residual_order")
        );
        for v in [
            json!({"kind":"sea","threshold":0.1}),
            json!({"kind":"sea","max_consecutive_cached":1,"retention_steps":3}),
        ] {
            assert!(
                request_setting("cache", Some(&sea), Some(&v)).is_ok(),
                "{v}"
            );
        }
    }
}
