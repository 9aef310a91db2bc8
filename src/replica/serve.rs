//! The replica listener's side: which calls are a peer's pull of this
//! replica's log, and what they ask. Anything else is answered with an
//! error naming what is wrong, never with the log.

use crate::config::ReplicasConfig;

use super::secret_matches;

/// Longest `wait` a pull may ask (a peer asks one report interval).
pub const MAX_WAIT_MS: u64 = 60_000;

/// A peer's pull: the log after `since` of `epoch`, held up to `wait_ms`
/// while there is nothing new: no decision after `since`, and this
/// replica's loads still those the peer holds (their digest `loads`,
/// [`super::wire::loads_digest`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRequest {
    pub since: u64,
    pub epoch: Option<String>,
    pub wait_ms: u64,
    pub loads: Option<u64>,
}

/// A call refused: its HTTP status and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u32,
    pub message: String,
}

fn refuse(status: u32, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        message: message.into(),
    }
}

/// Checks a call on the replica listener: `GET {replicas.path}?since=…`
/// with the shared secret in `key` ([`super::REPLICA_KEY_HEADER`]).
pub fn parse_log_request(
    config: &ReplicasConfig,
    method: &str,
    path: &str,
    key: Option<&[u8]>,
) -> Result<LogRequest, Refusal> {
    let (route, query) = path.split_once('?').unwrap_or((path, ""));
    if route != config.path {
        return Err(refuse(404, format!("no replica log at {route:?}")));
    }
    if !key.is_some_and(|key| secret_matches(key, config.secret.as_bytes())) {
        return Err(refuse(
            401,
            format!(
                "the replica log needs the replicas' secret in {}",
                super::REPLICA_KEY_HEADER
            ),
        ));
    }
    if method != "GET" {
        return Err(refuse(
            405,
            format!("method {method:?} is not allowed; use GET"),
        ));
    }
    let mut request = LogRequest {
        since: 0,
        epoch: None,
        wait_ms: 0,
        loads: None,
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let number = || {
            value.parse::<u64>().map_err(|_| {
                refuse(
                    400,
                    format!("`{name}` must be a whole number (got {value:?})"),
                )
            })
        };
        match name {
            "since" => request.since = number()?,
            "wait" => request.wait_ms = number()?.min(MAX_WAIT_MS),
            "epoch" if value.len() <= 64 && value.bytes().all(|b| b.is_ascii_alphanumeric()) => {
                request.epoch = Some(value.to_string());
            }
            "epoch" => {
                return Err(refuse(
                    400,
                    format!("`epoch` {value:?} is not a replica id"),
                ))
            }
            "loads" => {
                let digest = u64::from_str_radix(value, 16)
                    .map_err(|_| refuse(400, format!("`loads` {value:?} is not a hex digest")))?;
                request.loads = Some(digest);
            }
            _ => {}
        }
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ReplicasConfig {
        ReplicasConfig {
            peers: vec!["10.0.0.1:9902".into()],
            cluster: None,
            admin_cluster: "kvroute_admin".into(),
            secret: "0123456789abcdef0123456789abcdef".into(),
            path: "/kvroute/v1/replica".into(),
        }
    }

    const KEY: Option<&[u8]> = Some(b"0123456789abcdef0123456789abcdef");

    #[test]
    fn a_peer_pull_is_read_whole() {
        let request = parse_log_request(
            &config(),
            "GET",
            "/kvroute/v1/replica?since=41&epoch=00000000000000ab&wait=200&loads=ff&extra=1",
            KEY,
        )
        .expect("a pull");
        assert_eq!(
            request,
            LogRequest {
                since: 41,
                epoch: Some("00000000000000ab".into()),
                wait_ms: 200,
                loads: Some(0xff),
            }
        );
        let first = parse_log_request(&config(), "GET", "/kvroute/v1/replica", KEY).expect("pull");
        assert_eq!((first.since, first.epoch, first.wait_ms), (0, None, 0));
        let capped = parse_log_request(&config(), "GET", "/kvroute/v1/replica?wait=999999", KEY)
            .expect("pull");
        assert_eq!(capped.wait_ms, MAX_WAIT_MS);
    }

    #[test]
    fn anything_else_is_refused_naming_why() {
        let status = |method, path, key| {
            parse_log_request(&config(), method, path, key)
                .expect_err("refused")
                .status
        };
        assert_eq!(status("GET", "/v1/completions", KEY), 404);
        assert_eq!(status("GET", "/kvroute/v1/replica/x", KEY), 404);
        assert_eq!(status("GET", "/kvroute/v1/replica", None), 401);
        assert_eq!(status("GET", "/kvroute/v1/replica", Some(b"wrong")), 401);
        assert_eq!(status("POST", "/kvroute/v1/replica", KEY), 405);
        assert_eq!(status("GET", "/kvroute/v1/replica?since=-1", KEY), 400);
        assert_eq!(status("GET", "/kvroute/v1/replica?epoch=a%20b", KEY), 400);
        assert_eq!(status("GET", "/kvroute/v1/replica?loads=xyz", KEY), 400);
        let unauthorised =
            parse_log_request(&config(), "POST", "/kvroute/v1/replica", None).expect_err("refused");
        assert_eq!(unauthorised.status, 401, "the secret is checked first");
        assert!(unauthorised.message.contains("x-kvroute-replica-key"));
    }
}
