//! Target `config`: `plugin_configuration` values through [`Config::parse`].
//! An accepted configuration validates again, has a power-of-two bucket
//! count and builds a router that routes its own paths (those without a
//! query, which never match); a rejected one states a rule (its field may
//! be empty: an unknown field `""`).

use kvroute::config::Config;
use kvroute::router::Router;

pub fn run(data: &[u8]) {
    match Config::parse(data) {
        Ok(config) => {
            assert_eq!(config.validate(), Ok(()));
            assert!(config.snapshot_buckets().is_power_of_two());
            let router = Router::new(config.clone());
            for path in config.route_paths.iter().filter(|p| !p.contains('?')) {
                assert!(router.route_kind(path).is_some(), "route path {path:?}");
            }
        }
        Err(error) => assert!(!error.rule.is_empty(), "{error:?}"),
    }
}
