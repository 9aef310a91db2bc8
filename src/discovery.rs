//! Where a discovered pod set comes from; [`crate::cluster::ClusterState::
//! replace_pods`] validates and reconciles it, whichever the source.
//!
//! - `discovery`: a JSON endpoint answering `{"pods": [...]}` in the form
//!   of the configuration's `pods` ([`parse_pod_list`]).
//! - `membership`: Envoy's own membership of a cluster, whatever EDS, DNS
//!   or Istio put there. The service GETs Envoy's admin
//!   [`membership_path`] (`/clusters?format=json` filtered to that cluster)
//!   and [`parse_cluster_members`] turns each host into a pod: id and
//!   address = the host's `IP:port` as Envoy prints it (what the
//!   override-host policy matches), report and metrics from the same IP at
//!   `reportPort` / `metricsPort` when set. Hosts Envoy's control plane
//!   marks as leaving or unusable (EDS `UNHEALTHY`, `DRAINING`, `TIMEOUT`;
//!   pending removal; failing active health checks) are not members;
//!   outlier ejections are passing and left to kvroute's passive health. A
//!   cluster missing from the answer is an error, never an empty pod set.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use crate::config::{MembershipConfig, PodConfig};

/// `{"pods": [...]}` from a `discovery` endpoint.
pub fn parse_pod_list(body: &[u8]) -> Result<Vec<PodConfig>, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PodList {
        pods: Vec<PodConfig>,
    }
    serde_json::from_slice::<PodList>(body)
        .map(|list| list.pods)
        .map_err(|e| format!("malformed pod list: {e}"))
}

/// The admin path answering `cluster`'s hosts alone: `/clusters` takes an
/// RE2 `filter` on cluster names, here anchored and escaped (Istio's names
/// hold `|` and `.`), then percent-encoded.
pub fn membership_path(cluster: &str) -> String {
    let mut regex = String::from("^");
    for c in cluster.chars() {
        if c.is_ascii_punctuation() {
            regex.push('\\');
        }
        regex.push(c);
    }
    regex.push('$');
    let mut path = String::from("/clusters?format=json&filter=");
    for byte in regex.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            path.push(char::from(byte));
        } else {
            path.push_str(&format!("%{byte:02X}"));
        }
    }
    path
}

/// Envoy's `/clusters?format=json` (admin `Clusters` proto as JSON; proto3
/// leaves out default values, hence the defaults).
#[derive(Deserialize)]
struct AdminClusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    #[serde(default)]
    address: Option<HostAddress>,
    #[serde(default)]
    health_status: HealthStatus,
}

#[derive(Deserialize)]
struct HostAddress {
    /// Absent for pipes and internal addresses, which are no pods.
    #[serde(default)]
    socket_address: Option<SocketAddress>,
}

#[derive(Deserialize)]
struct SocketAddress {
    address: String,
    #[serde(default)]
    port_value: u16,
}

#[derive(Deserialize, Default)]
struct HealthStatus {
    #[serde(default)]
    eds_health_status: Option<String>,
    #[serde(default)]
    failed_active_health_check: bool,
    #[serde(default)]
    pending_dynamic_removal: bool,
}

impl HealthStatus {
    fn member(&self) -> bool {
        let leaving = matches!(
            self.eds_health_status.as_deref(),
            Some("UNHEALTHY" | "DRAINING" | "TIMEOUT")
        );
        !(leaving || self.failed_active_health_check || self.pending_dynamic_removal)
    }
}

/// The pods of `membership.cluster` in an admin `/clusters?format=json`
/// answer, in Envoy's order, each address once.
pub fn parse_cluster_members(
    body: &[u8],
    membership: &MembershipConfig,
) -> Result<Vec<PodConfig>, String> {
    Ok(cluster_members(body, &membership.cluster)?
        .into_iter()
        .map(|ip_port| {
            let at = |port: u16| SocketAddr::new(ip_port.ip(), port).to_string();
            let address = ip_port.to_string();
            PodConfig {
                id: address.clone(),
                address,
                report_address: membership.report_port.map(at),
                metrics_address: membership.metrics_port.map(at),
                attributes: Default::default(),
            }
        })
        .collect())
}

/// The members of `cluster` as `IP:port` addresses, as Envoy prints them
/// (the replicas of `replicas.cluster`).
pub fn cluster_member_addresses(body: &[u8], cluster: &str) -> Result<Vec<String>, String> {
    Ok(cluster_members(body, cluster)?
        .iter()
        .map(SocketAddr::to_string)
        .collect())
}

/// `cluster`'s members in Envoy's admin `/clusters` answer, each once.
fn cluster_members(body: &[u8], cluster: &str) -> Result<Vec<SocketAddr>, String> {
    let clusters: AdminClusters = serde_json::from_slice(body)
        .map_err(|e| format!("malformed admin /clusters answer: {e}"))?;
    let status = clusters
        .cluster_statuses
        .into_iter()
        .find(|c| c.name == cluster)
        .ok_or_else(|| format!("Envoy has no cluster {cluster:?}"))?;
    let mut members: Vec<SocketAddr> = Vec::new();
    // O(members): a cluster of 1,024 endpoints is read every round.
    let mut seen = HashSet::new();
    for host in status.host_statuses {
        if !host.health_status.member() {
            continue;
        }
        let Some(socket) = host.address.and_then(|a| a.socket_address) else {
            continue;
        };
        let ip: IpAddr = socket.address.parse().map_err(|_| {
            format!(
                "member address {:?} of {cluster:?} is not an IP",
                socket.address
            )
        })?;
        let member = SocketAddr::new(ip, socket.port_value);
        if seen.insert(member) {
            members.push(member);
        }
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn membership(report_port: Option<u16>) -> MembershipConfig {
        MembershipConfig {
            cluster: "kvroute_pods".into(),
            admin_cluster: "kvroute_admin".into(),
            report_port,
            metrics_port: None,
        }
    }

    /// Envoy 1.40's answer for an EDS cluster (stats shortened), as
    /// captured from `/clusters?format=json&filter=...`.
    const ADMIN_ANSWER: &str = r#"{
     "cluster_statuses": [
      {"name": "kvroute_pods",
       "host_statuses": [
        {"address": {"socket_address": {"address": "10.0.0.5", "port_value": 8000}},
         "stats": [{"name": "cx_connect_fail"}, {"type": "GAUGE", "name": "rq_active"}],
         "health_status": {"eds_health_status": "HEALTHY"}, "weight": 1, "hostname": "vllm-0", "locality": {}},
        {"address": {"socket_address": {"address": "fd00::7", "port_value": 8000}},
         "health_status": {"eds_health_status": "DEGRADED"}, "weight": 1, "locality": {}},
        {"address": {"socket_address": {"address": "10.0.0.6", "port_value": 8000}},
         "health_status": {"eds_health_status": "DRAINING"}, "weight": 1, "locality": {}},
        {"address": {"socket_address": {"address": "10.0.0.8", "port_value": 8000}},
         "health_status": {"eds_health_status": "UNHEALTHY"}, "weight": 1, "locality": {}},
        {"address": {"socket_address": {"address": "10.0.0.9", "port_value": 8000}},
         "health_status": {"failed_active_health_check": true, "eds_health_status": "HEALTHY"}},
        {"address": {"socket_address": {"address": "10.0.0.10", "port_value": 8000}},
         "health_status": {"pending_dynamic_removal": true}},
        {"address": {"socket_address": {"address": "10.0.0.5", "port_value": 8000}},
         "health_status": {"eds_health_status": "HEALTHY"}, "weight": 1},
        {"address": {"pipe": {"path": "/tmp/sock"}}, "health_status": {}}
       ],
       "observability_name": "kvroute_pods"}
     ]}"#;

    #[test]
    fn members_become_pods_named_by_address_with_ports_overridden() {
        let pods = parse_cluster_members(ADMIN_ANSWER.as_bytes(), &membership(Some(8081))).unwrap();
        let addresses: Vec<&str> = pods.iter().map(|p| p.address.as_str()).collect();
        // Healthy and degraded hosts, once each; leaving ones and pipes not.
        assert_eq!(addresses, ["10.0.0.5:8000", "[fd00::7]:8000"]);
        assert_eq!(pods[0].id, "10.0.0.5:8000");
        assert_eq!(pods[0].report_address.as_deref(), Some("10.0.0.5:8081"));
        assert_eq!(pods[1].report_address.as_deref(), Some("[fd00::7]:8081"));
        assert_eq!(pods[0].metrics_address, None);
        let pods = parse_cluster_members(ADMIN_ANSWER.as_bytes(), &membership(None)).unwrap();
        assert_eq!(pods[1].report_address, None);
    }

    #[test]
    fn a_missing_cluster_or_a_broken_answer_is_an_error_not_an_empty_set() {
        let missing = parse_cluster_members(b"{}", &membership(None)).unwrap_err();
        assert!(missing.contains("no cluster \"kvroute_pods\""), "{missing}");
        let empty = r#"{"cluster_statuses": [{"name": "kvroute_pods"}]}"#;
        assert_eq!(
            parse_cluster_members(empty.as_bytes(), &membership(None)).unwrap(),
            []
        );
        assert!(parse_cluster_members(b"<html>", &membership(None))
            .unwrap_err()
            .contains("malformed"));
        let named = r#"{"cluster_statuses": [{"name": "kvroute_pods", "host_statuses":
            [{"address": {"socket_address": {"address": "vllm.local", "port_value": 1}}}]}]}"#;
        assert!(parse_cluster_members(named.as_bytes(), &membership(None))
            .unwrap_err()
            .contains("not an IP"));
    }

    #[test]
    fn the_admin_filter_matches_exactly_the_one_cluster() {
        assert_eq!(
            membership_path("kvroute_pods"),
            "/clusters?format=json&filter=%5Ekvroute%5C_pods%24"
        );
        assert_eq!(
            membership_path("outbound|8000||vllm.ns.svc"),
            "/clusters?format=json&filter=%5Eoutbound%5C%7C8000%5C%7C%5C%7Cvllm%5C.ns%5C.svc%24"
        );
    }

    #[test]
    fn a_pod_list_is_the_configuration_s_pod_form() {
        let pods = parse_pod_list(br#"{"pods": [{"id": "a", "address": "10.0.0.1:80"}]}"#).unwrap();
        assert_eq!(pods[0].id, "a");
        assert!(parse_pod_list(br#"{"pods": [], "extra": 1}"#)
            .unwrap_err()
            .starts_with("malformed pod list"));
    }
}
