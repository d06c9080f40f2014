//! End-to-end tests of layerwise against a real Kubernetes control plane on this machine.
//!
//! The cluster is the one `tests/cluster/up` starts: kube-apiserver, etcd, the controller
//! manager and the scheduler built from source, with kwok playing the kubelet of fake
//! accelerator nodes. [`cluster::client`] brings it up once per test process (or reuses the
//! one `KUBECONFIG` names); [`shapes`] reads the fleet it was given; [`net`] checks the rule
//! that everything the tests start talks only to loopback; [`images`] runs the
//! project's container images; [`monitors`] follows the Prometheus Operator's monitors to
//! their scrape targets; [`dra`] is a fake DRA driver's node and ResourceSlice;
//! [`engine_objects`] are the engine pods and Services the operator's own code makes.
//! [`s3`] is a real S3-compatible server (SeaweedFS) for the model sources; [`scenario`] is
//! what the tests that run the chart under the node runner share.

pub mod cluster;
pub mod dra;
pub mod engine_objects;
pub mod fixtures;
pub mod images;
pub mod monitors;
pub mod net;
pub mod runner;
pub mod s3;
pub mod scenario;
pub mod shapes;
pub mod tools;
