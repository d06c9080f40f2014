//! Jobs behind a Service: three real `layerwise serve` processes with one job key, and a
//! round-robin TCP proxy in front of them standing in for the Service (kube-proxy), so every
//! request lands on the next replica whichever owns the job. Clients that know only the
//! proxy submit images and videos, poll them to the end and download them; every fetch must
//! answer with the right job (its id, seed and prompt; the bytes its owner holds), and the
//! replicas' own count of forwarded requests must match the requests that landed elsewhere.
//! Forged ids are 404s that make no connection; a job whose owner was killed, or restarted,
//! is a quick 410 naming it; without a key nothing is forwarded.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use common::process::{spawn, spawn_with, Server, T};
use layerwise_engine::server::ids::{JobIds, Owner};
use layerwise_engine::tools::loadgen::{http, HttpResponse};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The deployment's key, as the operator's Secret holds one (64 hex digits).
const KEY: &str = "6b1d0e5f2a9c47d83e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f";
const ARGS: [&str; 12] = [
    "--dp",
    "1",
    "--slots",
    "2",
    "--max-width",
    "64",
    "--max-height",
    "64",
    "--max-frames",
    "17",
    "--max-steps",
    "50",
];
/// The longest a replica may take to say a job's owner is gone (a hang guard, not a target).
const GONE_WITHIN: Duration = Duration::from_secs(10);

/// A round-robin TCP proxy: each connection goes to the next backend, as kube-proxy sends
/// each connection to some endpoint of the Service. It records where each one went.
struct Proxy {
    addr: SocketAddr,
    backends: Arc<Mutex<Vec<SocketAddr>>>,
    log: Arc<Mutex<Vec<SocketAddr>>>,
    task: JoinHandle<()>,
}

impl Proxy {
    async fn start(backends: Vec<SocketAddr>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backends = Arc::new(Mutex::new(backends));
        let log = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let (backends, log) = (backends.clone(), log.clone());
            async move {
                let mut next = 0;
                loop {
                    let Ok((mut client, _)) = listener.accept().await else {
                        continue;
                    };
                    let to = {
                        let b = backends.lock().unwrap();
                        b[next % b.len()]
                    };
                    next += 1;
                    log.lock().unwrap().push(to);
                    tokio::spawn(async move {
                        if let Ok(mut up) = TcpStream::connect(to).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                        }
                    });
                }
            }
        });
        Proxy {
            addr,
            backends,
            log,
            task,
        }
    }

    /// The Service's endpoints changed (a pod went, or came back).
    fn set(&self, backends: Vec<SocketAddr>) {
        *self.backends.lock().unwrap() = backends;
    }

    fn log(&self) -> Vec<SocketAddr> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn call(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> HttpResponse {
    let b = body.map(|b| b.to_string().into_bytes());
    http(addr, method, path, b.as_deref(), T).await.unwrap()
}

fn text(r: &HttpResponse) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

/// Requests a replica sent on to another and got an answer for, from its `/metrics`.
async fn forwarded(addr: SocketAddr, outcome: &str) -> u64 {
    let m = text(&call(addr, "GET", "/metrics", None).await);
    let line = format!("layerwise_job_requests_forwarded_total{{outcome=\"{outcome}\"}} ");
    m.lines()
        .find_map(|l| l.strip_prefix(&line))
        .map_or(0, |n| n.trim().parse().unwrap())
}

struct Job {
    id: String,
    video: bool,
    seed: u64,
    prompt: String,
    owner: SocketAddr,
}

impl Job {
    fn status_path(&self) -> String {
        if self.video {
            format!("/v1/videos/{}", self.id)
        } else {
            format!("/v1/jobs/{}", self.id)
        }
    }
    fn content_path(&self) -> String {
        if self.video {
            format!("/v1/videos/{}/content", self.id)
        } else {
            format!("/v1/jobs/{}/result", self.id)
        }
    }
}

/// Requests sent through the proxy, each with the replica that owns the job it names, so
/// the test knows which of them a replica had to forward.
struct Client<'a> {
    proxy: &'a Proxy,
    owners: Vec<Option<SocketAddr>>,
    first: usize,
}

impl<'a> Client<'a> {
    fn new(proxy: &'a Proxy) -> Client<'a> {
        Client {
            proxy,
            owners: Vec::new(),
            first: proxy.log().len(),
        }
    }

    /// One request at a time: the proxy's log then lines up with `owners`.
    async fn call(
        &mut self,
        owner: Option<SocketAddr>,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> HttpResponse {
        self.owners.push(owner);
        call(self.proxy.addr, method, path, body).await
    }

    /// Requests that landed on a replica other than their job's owner.
    fn landed_elsewhere(&self) -> usize {
        let log = self.proxy.log();
        assert_eq!(log.len() - self.first, self.owners.len(), "proxy log");
        log[self.first..]
            .iter()
            .zip(&self.owners)
            .filter(|(to, owner)| owner.is_some_and(|o| o != **to))
            .count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_replica_answers_for_every_job() {
    let dir = tempfile::tempdir().unwrap();
    let wan = common::wan_tiny(dir.path(), 2, 2);
    let dit = common::tiny(dir.path(), 2);
    let env = [("LAYERWISE_JOB_KEY", KEY)];
    let mut replicas: Vec<Server> = (0..3)
        .map(|_| spawn_with(&wan, "127.0.0.1:0", &ARGS, &env))
        .collect();
    let keyless: Vec<Server> = (0..2)
        .map(|_| spawn(&dit, &["--dp", "1", "--slots", "2"]))
        .collect();
    for s in replicas.iter().chain(&keyless) {
        s.wait_ready().await;
    }
    let addrs: Vec<SocketAddr> = replicas.iter().map(|s| s.addr).collect();
    let proxy = Proxy::start(addrs.clone()).await;
    // Reads ids as a replica at an address none of them has.
    let reader = JobIds::keyed(KEY.parse().unwrap(), "127.0.0.1:9".parse().unwrap());
    let owner_of = |id: &str| match reader.parse(id) {
        Ok(Owner::Peer(a)) => a,
        other => panic!("id {id}: {other:?}"),
    };
    let started = Instant::now();

    // 1. Six images and three videos, submitted through the Service.
    let mut client = Client::new(&proxy);
    let mut jobs = Vec::new();
    for i in 0..9u64 {
        let video = matches!(i, 2 | 4 | 6);
        let prompt = format!("a red kite over a beach, take {i}");
        let (path, body) = if video {
            (
                "/v1/videos",
                json!({ "prompt": prompt, "size": "32x32", "frames": 5, "steps": 2, "seed": i }),
            )
        } else {
            (
                "/v1/jobs",
                json!({ "prompt": prompt, "size": "32x32", "steps": 2, "seed": i }),
            )
        };
        let r = client.call(None, "POST", path, Some(body)).await;
        assert_eq!(r.status, 202, "POST {path}: {}", text(&r));
        let id = r.json().unwrap()["id"].as_str().unwrap().to_string();
        assert_eq!(
            r.header("location"),
            Some(if video {
                format!("/v1/videos/{id}")
            } else {
                format!("/v1/jobs/{id}")
            })
            .as_deref()
        );
        jobs.push(Job {
            owner: owner_of(&id),
            id,
            video,
            seed: i,
            prompt,
        });
    }
    for a in &addrs {
        assert_eq!(
            jobs.iter().filter(|j| j.owner == *a).count(),
            3,
            "replica {a} took every third job"
        );
    }

    // 2. Polled to the end and downloaded through the Service, one request at a time.
    let deadline = Instant::now() + T;
    let mut polls = 0;
    for job in &jobs {
        loop {
            let r = client
                .call(Some(job.owner), "GET", &job.status_path(), None)
                .await;
            polls += 1;
            assert_eq!(r.status, 200, "GET {}: {}", job.status_path(), text(&r));
            let v = r.json().unwrap();
            assert_eq!(v["id"], job.id.as_str(), "{v}");
            assert_eq!(v["seed"], job.seed, "{v}");
            assert_eq!(v["prompt"], job.prompt.as_str(), "{v}");
            let done = if job.video {
                assert_eq!(v["object"], "video", "{v}");
                v["status"] == "completed"
            } else {
                v["state"] == "succeeded"
            };
            if done {
                break;
            }
            assert!(v["error"].is_null(), "{v}");
            assert!(Instant::now() < deadline, "{} never finished: {v}", job.id);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut outputs = std::collections::HashSet::new();
    for job in &jobs {
        let via = client
            .call(Some(job.owner), "GET", &job.content_path(), None)
            .await;
        assert_eq!(
            via.status,
            200,
            "GET {}: {}",
            job.content_path(),
            text(&via)
        );
        let direct = call(job.owner, "GET", &job.content_path(), None).await;
        assert_eq!(direct.status, 200);
        assert!(
            via.body == direct.body,
            "{}: {} bytes through the Service, {} from the owner",
            job.id,
            via.body.len(),
            direct.body.len()
        );
        let (magic, kind): (&[u8], &str) = if job.video {
            (&via.body[4..8], "video/mp4")
        } else {
            (&via.body[1..4], "image/png")
        };
        assert_eq!(
            (magic, via.header("content-type")),
            (
                if job.video { &b"ftyp"[..] } else { &b"PNG"[..] },
                Some(kind)
            )
        );
        assert!(
            outputs.insert(via.body.clone()),
            "{} repeats an output",
            job.id
        );
        if job.video {
            let path = format!("{}?variant=thumbnail", job.content_path());
            let thumb = client.call(Some(job.owner), "GET", &path, None).await;
            assert_eq!(thumb.status, 200, "GET {path}: {}", text(&thumb));
            assert_eq!(&thumb.body[1..4], b"PNG");
        }
    }

    // 3. Cancel and delete through the Service too.
    for job in jobs.iter().filter(|j| j.video) {
        let r = client
            .call(Some(job.owner), "DELETE", &job.status_path(), None)
            .await;
        assert_eq!(r.status, 200, "DELETE {}: {}", job.status_path(), text(&r));
        let v = r.json().unwrap();
        assert_eq!(
            (v["id"].as_str(), v["deleted"].as_bool()),
            (Some(job.id.as_str()), Some(true))
        );
        let r = client
            .call(Some(job.owner), "GET", &job.content_path(), None)
            .await;
        assert_eq!(r.status, 410, "after DELETE: {}", text(&r));
    }
    let image = &jobs[0];
    let r = client
        .call(Some(image.owner), "DELETE", &image.status_path(), None)
        .await;
    assert_eq!(r.status, 200, "{}", text(&r));
    assert_eq!(r.json().unwrap()["id"], image.id.as_str());

    let mut sent_on = 0;
    for a in &addrs {
        sent_on += forwarded(*a, "ok").await;
    }
    let elsewhere = client.landed_elsewhere();
    assert_eq!(
        sent_on as usize, elsewhere,
        "requests the replicas forwarded vs requests that landed on a replica not owning the job"
    );
    assert!(elsewhere > 0);
    let requests = client.owners.len();
    eprintln!(
        "jobs behind a service: 9 jobs on 3 replicas in {:.1} s; {requests} requests through the proxy ({polls} polls), {sent_on} forwarded to the owner",
        started.elapsed().as_secs_f64()
    );

    // 4. Forged ids: a 404 naming the id, and no connection to what they name.
    let victim = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = victim.local_addr().unwrap();
    let dialled = Arc::new(AtomicUsize::new(0));
    let watch = tokio::spawn({
        let dialled = dialled.clone();
        async move {
            while let Ok((s, _)) = victim.accept().await {
                dialled.fetch_add(1, Ordering::SeqCst);
                drop(s);
            }
        }
    });
    let wrong_key = JobIds::keyed(
        "another deployment's key, 32 bytes".parse().unwrap(),
        target,
    )
    .format(7);
    // A real id of replica 0's with the victim's address put in place of the owner's.
    let mut swapped = URL_SAFE_NO_PAD.decode(&jobs[0].id).unwrap();
    swapped[13..15].copy_from_slice(&target.port().to_be_bytes());
    let std::net::IpAddr::V4(ip) = target.ip() else {
        unreachable!()
    };
    swapped[15..19].copy_from_slice(&ip.octets());
    let swapped = URL_SAFE_NO_PAD.encode(swapped);
    let vouched = JobIds::keyed(KEY.parse().unwrap(), target).format(7);
    let mut bad_tag = URL_SAFE_NO_PAD.decode(&vouched).unwrap();
    *bad_tag.last_mut().unwrap() ^= 0x80;
    let bad_tag = URL_SAFE_NO_PAD.encode(bad_tag);
    for forged in [
        &wrong_key,
        &swapped,
        &bad_tag,
        &"0123456789abcdef".to_string(),
    ] {
        for path in [
            format!("/v1/jobs/{forged}"),
            format!("/v1/jobs/{forged}/result"),
            format!("/v1/videos/{forged}"),
        ] {
            let r = call(proxy.addr, "GET", &path, None).await;
            assert_eq!(r.status, 404, "GET {path}: {}", text(&r));
            let v = r.json().unwrap();
            assert_eq!(v["error"]["type"], "not_found", "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains(forged.as_str()),
                "{v}"
            );
        }
        let r = call(proxy.addr, "DELETE", &format!("/v1/videos/{forged}"), None).await;
        assert_eq!(r.status, 404, "{}", text(&r));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        dialled.load(Ordering::SeqCst),
        0,
        "a forged id made a replica connect to the address it names"
    );
    // The control: an id the key does vouch for is dialled (and its "owner", which hangs
    // up at once, makes a 502).
    let r = call(proxy.addr, "GET", &format!("/v1/jobs/{vouched}"), None).await;
    assert_eq!(r.status, 502, "{}", text(&r));
    assert_eq!(r.json().unwrap()["error"]["type"], "replica_unreachable");
    assert_eq!(dialled.load(Ordering::SeqCst), 1);
    watch.abort();

    // 5. An owner that is killed: its jobs are a quick 410 naming them, through whichever
    //    replica the Service picks; then restarted at the same address: still a 410.
    let gone = replicas.pop().unwrap();
    let gone_addr = gone.addr;
    drop(gone);
    proxy.set(addrs[..2].to_vec());
    let orphans: Vec<&Job> = jobs.iter().filter(|j| j.owner == gone_addr).collect();
    let mut slowest = Duration::ZERO;
    for job in orphans.iter().chain(&orphans) {
        let t0 = Instant::now();
        let r = call(proxy.addr, "GET", &job.status_path(), None).await;
        slowest = slowest.max(t0.elapsed());
        assert_eq!(r.status, 410, "GET {}: {}", job.status_path(), text(&r));
        let v = r.json().unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert_eq!(v["error"]["type"], "replica_gone", "{v}");
        assert!(
            msg.contains(&job.id) && msg.contains("no longer running"),
            "{msg}"
        );
        assert!(t0.elapsed() < GONE_WITHIN, "{:?}", t0.elapsed());
    }
    let restarted = spawn_with(&wan, &gone_addr.to_string(), &ARGS, &env);
    restarted.wait_ready().await;
    proxy.set(vec![addrs[0], addrs[1], restarted.addr]);
    for _ in 0..3 {
        let job = orphans[0];
        let r = call(proxy.addr, "GET", &job.content_path(), None).await;
        assert_eq!(r.status, 410, "GET {}: {}", job.content_path(), text(&r));
        let msg = r.json().unwrap()["error"]["message"].to_string();
        assert!(msg.contains(&job.id) && msg.contains("restarted"), "{msg}");
    }
    // Jobs of the replicas still running are still there.
    let r = call(proxy.addr, "GET", &jobs[1].status_path(), None).await;
    assert_eq!(r.status, 200, "{}", text(&r));
    eprintln!(
        "jobs behind a service: a killed owner's job answered 410 in at most {:.0} ms",
        slowest.as_secs_f64() * 1e3
    );

    // 6. Without a key ids are local (16 hex digits of the number, 32 of its tag), and the
    //    replica that does not hold a job says so.
    let plain = Proxy::start(keyless.iter().map(|s| s.addr).collect()).await;
    let r = call(
        plain.addr,
        "POST",
        "/v1/jobs",
        Some(json!({ "class_label": 1, "steps": 2 })),
    )
    .await;
    assert_eq!(r.status, 202, "{}", text(&r));
    let id = r.json().unwrap()["id"].as_str().unwrap().to_string();
    assert!(
        id.len() == 48 && id.bytes().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );
    let mut answers = Vec::new();
    for _ in 0..2 {
        let r = call(plain.addr, "GET", &format!("/v1/jobs/{id}"), None).await;
        answers.push(r.status);
        if r.status == 404 {
            let msg = r.json().unwrap()["error"]["message"].to_string();
            assert!(msg.contains(&format!("no job `{id}`")), "{msg}");
        }
    }
    answers.sort();
    assert_eq!(
        answers,
        [200, 404],
        "one replica holds the job, the other does not"
    );
    for s in &keyless {
        assert_eq!(forwarded(s.addr, "ok").await, 0);
    }
}

/// A job on a draining replica is still read through the Service: once SIGTERM takes the
/// owner out of the Service (its readiness fails, the proxy drops it), the other replica
/// forwards the client's polls and download to it until the job has finished and been read;
/// then the owner exits, well within its grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_a_draining_replica_is_read_through_the_service() {
    let dir = tempfile::tempdir().unwrap();
    let dit = common::tiny(dir.path(), 8);
    let env = [("LAYERWISE_JOB_KEY", KEY)];
    let args = ["--dp", "1", "--grace-seconds", "60"];
    let mut owner = spawn_with(&dit, "127.0.0.1:0", &args, &env);
    let other = spawn_with(&dit, "127.0.0.1:0", &args, &env);
    owner.wait_ready().await;
    other.wait_ready().await;
    let proxy = Proxy::start(vec![owner.addr, other.addr]).await;
    // About 3 s of work on 2 cores: still running when SIGTERM lands.
    let body = json!({ "class_label": 1, "seed": 5, "steps": 250, "size": "128x128" });
    let r = call(owner.addr, "POST", "/v1/jobs", Some(body)).await;
    assert_eq!(r.status, 202, "{}", text(&r));
    let id = r.json().unwrap()["id"].as_str().unwrap().to_string();
    let t = Instant::now();
    // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
    assert_eq!(
        unsafe { libc::kill(owner.child.id() as i32, libc::SIGTERM) },
        0
    );
    // The signal is delivered asynchronously: readiness fails as soon as the server's handler
    // has run, which the kubelet's probe (here, this loop) observes a moment later.
    let deadline = Instant::now() + Duration::from_secs(5);
    while call(owner.addr, "GET", "/readyz", None).await.status != 503 {
        assert!(
            Instant::now() < deadline,
            "readiness never failed after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The endpoints controller drops the unready pod: every connection goes to the other.
    *proxy.backends.lock().unwrap() = vec![other.addr];
    let deadline = Instant::now() + T;
    loop {
        let r = call(proxy.addr, "GET", &format!("/v1/jobs/{id}"), None).await;
        assert_eq!(r.status, 200, "{}", text(&r));
        let st = r.json().unwrap();
        if st["state"] == "succeeded" {
            break;
        }
        assert_eq!(st["state"], "running", "{st}");
        assert!(Instant::now() < deadline, "never finished: {st}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = call(proxy.addr, "GET", &format!("/v1/jobs/{id}/result"), None).await;
    assert_eq!(r.status, 200, "{}", text(&r));
    assert_eq!(r.header("content-type"), Some("image/png"));
    assert!(forwarded(other.addr, "ok").await >= 2);
    // Read: the owner leaves without waiting out its 60 s grace.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = owner.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the drained owner did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0), "{status:?}");
    eprintln!("owner drained and exited {:?} after SIGTERM", t.elapsed());
}
