//! The `clusterset.local` zone of one cluster (the MCS DNS specification): built whole from the
//! cluster's imports after every change, then answered from memory.
//!
//! For an imported Service `<svc>` of namespace `<ns>`:
//! - `<svc>.<ns>.svc.<zone>` A/AAAA: the ServiceImport's clusterset IPs when it has them (the
//!   Kubernetes import side gives each import the derived Service's cluster IP); otherwise, as
//!   for a headless Service, the ready addresses of every exporting cluster's endpoints, as this
//!   cluster addresses them;
//! - `<svc>.<ns>.svc.<zone>` SRV: one record per port pointing at the Service name (clusterset
//!   IP), or one per port and endpoint pointing at the endpoint's name (headless);
//!   `_<port>._<proto>.<svc>.<ns>.svc.<zone>` SRV the same for each named port;
//! - `<host>.<cluster>.<svc>.<ns>.svc.<zone>` A/AAAA: one endpoint of `<cluster>`, where
//!   `<host>` is the endpoint's hostname (StatefulSet pods) or, without one, its address with
//!   `.` and `:` written as `-`.
//!
//! A name under the zone that nothing holds is NXDOMAIN; a name that exists (or has names
//! below it) without records of the asked type is an empty answer (NODATA); a name outside
//! the zone is refused.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use hickory_proto::rr::rdata::{A, AAAA, SOA, SRV};
use hickory_proto::rr::{LowerName, Name, RData, Record, RecordType};

use crate::imports::{Reachability, merge, origin_of};
use crate::model::{AddressType, Port, Protocol};
use crate::records::ReflectedRecord;

/// One imported Service as the zone sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZoneService {
    pub namespace: String,
    pub name: String,
    /// A headless import: names answer the endpoints.
    pub headless: bool,
    /// The ServiceImport's clusterset IPs; empty: answer the endpoints (as headless).
    pub clusterset_ips: Vec<IpAddr>,
    pub ports: Vec<Port>,
    /// Ready endpoints this cluster can reach, over every exporting cluster.
    pub endpoints: Vec<ZoneEndpoint>,
}

/// One ready endpoint of an imported Service.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ZoneEndpoint {
    /// The exporting cluster.
    pub cluster: String,
    /// As this cluster addresses it.
    pub address: IpAddr,
    pub hostname: Option<String>,
}

/// The imports of `records` as zone services: ready endpoints only (after `reach` marked those
/// this cluster cannot reach), with `clusterset_ips` by (namespace, name) where known.
pub fn services(
    records: &[ReflectedRecord],
    reach: &Reachability,
    clusterset_ips: &BTreeMap<(String, String), Vec<IpAddr>>,
) -> Vec<ZoneService> {
    // The Service's ports are the ServiceImport's: the first exporter's when they disagree.
    let mut by_key: BTreeMap<(String, String), ZoneService> = merge(records)
        .into_iter()
        .map(|(key, import)| {
            let headless = import.is_headless();
            let service = ZoneService {
                namespace: import.namespace,
                name: import.name,
                headless,
                clusterset_ips: if headless {
                    Vec::new()
                } else {
                    clusterset_ips.get(&key).cloned().unwrap_or_default()
                },
                ports: import.service.ports,
                endpoints: Vec::new(),
            };
            (key, service)
        })
        .collect();
    for record in records {
        let slice = reach.mark(&record.slice);
        if slice.address_type == AddressType::Fqdn {
            continue;
        }
        let key = (slice.namespace.clone(), slice.service_name.clone());
        let Some(service) = by_key.get_mut(&key) else {
            continue;
        };
        let cluster = origin_of(record);
        for endpoint in &slice.endpoints {
            if endpoint.conditions.ready == Some(false) {
                continue;
            }
            for address in &endpoint.addresses {
                if let Ok(address) = address.parse::<IpAddr>() {
                    service.endpoints.push(ZoneEndpoint {
                        cluster: cluster.clone(),
                        address,
                        hostname: endpoint.hostname.clone(),
                    });
                }
            }
        }
    }
    by_key
        .into_values()
        .map(|mut service| {
            service.endpoints.sort();
            service.endpoints.dedup();
            service
        })
        .collect()
}

/// What the zone answers to one question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// NOERROR with these records; empty is NODATA (the name exists, not with that type).
    Records(Vec<Record>),
    /// The name does not exist in the zone.
    NxDomain,
    /// The name is outside the zone.
    Refused,
}

/// The zone, ready to answer.
#[derive(Debug, Clone)]
pub struct Zone {
    origin: LowerName,
    soa: Record,
    names: HashMap<LowerName, Vec<Record>>,
    /// Names that exist only because names below them do (`<ns>.svc.<zone>`, `svc.<zone>`).
    ancestors: HashSet<LowerName>,
}

/// The port of an SRV record, or none when the port cannot be one.
fn port_number(port: &Port) -> Option<u16> {
    port.port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p > 0)
}

fn protocol_label(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Tcp => "_tcp",
        Protocol::Udp => "_udp",
        Protocol::Sctp => "_sctp",
    }
}

/// `address` as one DNS label: `10-1-0-7`, `fd00--7`.
fn address_label(address: IpAddr) -> String {
    address.to_string().replace(['.', ':'], "-")
}

fn address_record(name: &Name, ttl: u32, address: IpAddr) -> Record {
    let data = match address {
        IpAddr::V4(v4) => RData::A(A(v4)),
        IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
    };
    Record::from_rdata(name.clone(), ttl, data)
}

impl Zone {
    /// The zone `origin` (e.g. `clusterset.local.`) holding `services`, every record with `ttl`
    /// seconds; `serial` is the SOA's (it should grow with every rebuild).
    pub fn build(origin: &Name, ttl: u32, serial: u32, services: &[ZoneService]) -> Self {
        let mut origin = origin.clone();
        origin.set_fqdn(true);
        let mut zone = Self {
            origin: LowerName::new(&origin),
            soa: soa(&origin, ttl, serial),
            names: HashMap::new(),
            ancestors: HashSet::new(),
        };
        for service in services {
            // A namespace or Service name that is no DNS label has no name (Kubernetes names
            // always are; reflected slices were validated as label values).
            let Ok(name) = Name::from_labels([
                service.name.as_bytes(),
                service.namespace.as_bytes(),
                b"svc",
            ])
            .and_then(|n| n.append_domain(&origin)) else {
                continue;
            };
            zone.add_service(&name, ttl, service);
        }
        zone.finish();
        zone.add_ancestors();
        zone
    }

    /// Adds a record; duplicates go in [`Self::finish`] (an RRset is a set, RFC 2181), once,
    /// rather than by a search per record, which made a 1000-endpoint Service cost a million
    /// comparisons per rebuild.
    fn add(&mut self, record: Record) {
        self.names
            .entry(LowerName::new(record.name()))
            .or_default()
            .push(record);
    }

    /// Every name's records sorted, without duplicates.
    fn finish(&mut self) {
        for records in self.names.values_mut() {
            records.sort();
            records.dedup();
        }
    }

    fn add_service(&mut self, name: &Name, ttl: u32, service: &ZoneService) {
        let headless = service.clusterset_ips.is_empty();
        if headless {
            for endpoint in &service.endpoints {
                self.add(address_record(name, ttl, endpoint.address));
            }
        } else {
            for ip in &service.clusterset_ips {
                self.add(address_record(name, ttl, *ip));
            }
        }
        // SRV targets: the Service name, or each endpoint's own name (also given its address).
        let mut targets = Vec::new();
        if headless {
            for endpoint in &service.endpoints {
                let host = endpoint
                    .hostname
                    .clone()
                    .unwrap_or_else(|| address_label(endpoint.address));
                let Ok(target) = Name::from_labels([host.as_bytes(), endpoint.cluster.as_bytes()])
                    .and_then(|n| n.append_domain(name))
                else {
                    continue;
                };
                self.add(address_record(&target, ttl, endpoint.address));
                targets.push(target);
            }
        } else {
            targets.push(name.clone());
        }
        for port in &service.ports {
            let Some(number) = port_number(port) else {
                continue;
            };
            let named = port.name.as_ref().and_then(|port_name| {
                Name::from_labels([
                    format!("_{port_name}").as_bytes(),
                    protocol_label(port.protocol).as_bytes(),
                ])
                .and_then(|n| n.append_domain(name))
                .ok()
            });
            for target in &targets {
                let srv = RData::SRV(SRV::new(0, weight(targets.len()), number, target.clone()));
                self.add(Record::from_rdata(name.clone(), ttl, srv.clone()));
                if let Some(named) = &named {
                    self.add(Record::from_rdata(named.clone(), ttl, srv));
                }
            }
        }
    }

    /// Every name between a record's name and the origin, so that they answer NODATA.
    fn add_ancestors(&mut self) {
        let origin_labels = self.origin.num_labels();
        let mut ancestors = BTreeSet::new();
        for name in self.names.keys() {
            let mut parent = name.base_name();
            while parent.num_labels() > origin_labels {
                ancestors.insert(parent.clone());
                parent = parent.base_name();
            }
        }
        self.ancestors = ancestors
            .into_iter()
            .filter(|n| !self.names.contains_key(n))
            .collect();
    }

    /// The origin's SOA record, for the authority section of negative answers.
    pub fn soa(&self) -> &Record {
        &self.soa
    }

    /// Names with records (for metrics).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether the zone holds no name but its origin.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The answer to `name` `query_type`.
    pub fn answer(&self, name: &LowerName, query_type: RecordType) -> Answer {
        if !self.origin.zone_of(name) {
            return Answer::Refused;
        }
        if *name == self.origin {
            let apex = match query_type {
                RecordType::SOA | RecordType::ANY => vec![self.soa.clone()],
                _ => Vec::new(),
            };
            return Answer::Records(apex);
        }
        match self.names.get(name) {
            Some(records) => Answer::Records(
                records
                    .iter()
                    .filter(|r| query_type == RecordType::ANY || r.record_type() == query_type)
                    .cloned()
                    .collect(),
            ),
            None if self.ancestors.contains(name) => Answer::Records(Vec::new()),
            None => Answer::NxDomain,
        }
    }
}

/// Equal weights summing to about 100 (RFC 2782: weight is a relative share).
fn weight(targets: usize) -> u16 {
    u16::try_from(100 / targets.max(1)).unwrap_or(1).max(1)
}

/// The zone's SOA: its negative answers are cached for `ttl` seconds too (RFC 2308).
fn soa(origin: &Name, ttl: u32, serial: u32) -> Record {
    let label = |first: &str| {
        Name::from_labels([first.as_bytes()])
            .and_then(|n| n.append_domain(origin))
            .unwrap_or_else(|_| origin.clone())
    };
    let refresh = i32::try_from(ttl).unwrap_or(i32::MAX);
    Record::from_rdata(
        origin.clone(),
        ttl,
        RData::SOA(SOA::new(
            label("ns"),
            label("hostmaster"),
            serial,
            refresh,
            refresh,
            refresh.saturating_mul(10),
            ttl,
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exports::ORIGIN_LABEL;
    use crate::model::{Conditions, Endpoint, Slice};
    use trellis_api::{ClusterId, ClusterIdentity};

    fn id(s: &str) -> ClusterId {
        ClusterId::parse("id", s).expect("id")
    }

    /// A slice of `web.shop` exported by `origin`, reflected to us by `source`.
    fn record(
        source: &str,
        origin: &str,
        endpoints: &[(&str, Option<&str>, bool)],
    ) -> ReflectedRecord {
        ReflectedRecord {
            source: ClusterIdentity {
                id: id(source),
                name: String::new(),
            },
            slice: Slice {
                namespace: "shop".into(),
                name: format!("web.{origin}"),
                service_name: "web".into(),
                address_type: AddressType::IPv4,
                endpoints: endpoints
                    .iter()
                    .map(|(address, hostname, ready)| Endpoint {
                        addresses: vec![(*address).to_owned()],
                        conditions: Conditions {
                            ready: (!ready).then_some(false),
                            ..Conditions::default()
                        },
                        hostname: hostname.map(str::to_owned),
                        node_name: None,
                        zone: None,
                    })
                    .collect(),
                ports: vec![Port {
                    name: Some("http".into()),
                    port: Some(80),
                    protocol: Protocol::Tcp,
                    app_protocol: None,
                }],
                labels: BTreeMap::from([(ORIGIN_LABEL.to_owned(), origin.to_owned())]),
                service: None,
            },
            generation: 1,
            object_name: None,
            update_time_nanos: 0,
        }
    }

    /// Clusters a and c reachable at 10.1/16 and 10.3/16; b's 10.2/16 known but not peered.
    fn reach() -> Reachability {
        Reachability::new(
            vec![
                ("10.1.0.0/16".parse().expect("net"), id("a")),
                ("10.2.0.0/16".parse().expect("net"), id("b")),
                ("10.3.0.0/16".parse().expect("net"), id("c")),
            ],
            BTreeSet::from([id("a"), id("c")]),
        )
    }

    fn zone(records: &[ReflectedRecord], ips: &BTreeMap<(String, String), Vec<IpAddr>>) -> Zone {
        let origin = Name::from_ascii("clusterset.local.").expect("origin");
        Zone::build(&origin, 5, 1, &services(records, &reach(), ips))
    }

    fn ask(zone: &Zone, name: &str, qtype: RecordType) -> Answer {
        zone.answer(
            &LowerName::from(Name::from_ascii(name).expect("name")),
            qtype,
        )
    }

    fn data(answer: &Answer) -> Vec<String> {
        let Answer::Records(records) = answer else {
            panic!("expected records, got {answer:?}");
        };
        let mut out: Vec<String> = records.iter().map(|r| r.data().to_string()).collect();
        out.sort();
        out
    }

    #[test]
    fn a_service_without_clusterset_ip_answers_the_ready_reachable_endpoints_of_every_exporter() {
        let z = zone(
            &[
                record(
                    "a",
                    "a",
                    &[("10.1.0.7", None, true), ("10.1.0.8", None, false)],
                ),
                record("a", "c", &[("10.3.0.9", Some("web-0"), true)]),
                record("a", "b", &[("10.2.0.5", None, true)]),
            ],
            &BTreeMap::new(),
        );
        let name = "web.shop.svc.clusterset.local.";
        // Not ready (10.1.0.8) and unreachable (b's 10.2.0.5) are left out.
        assert_eq!(
            data(&ask(&z, name, RecordType::A)),
            ["10.1.0.7", "10.3.0.9"]
        );
        assert_eq!(
            data(&ask(&z, "WEB.Shop.svc.ClusterSet.local.", RecordType::A)),
            ["10.1.0.7", "10.3.0.9"],
            "names are case-insensitive"
        );
        assert_eq!(
            data(&ask(&z, name, RecordType::SRV)),
            [
                "0 50 80 10-1-0-7.a.web.shop.svc.clusterset.local.",
                "0 50 80 web-0.c.web.shop.svc.clusterset.local."
            ]
        );
        assert_eq!(
            data(&ask(
                &z,
                "_http._tcp.web.shop.svc.clusterset.local.",
                RecordType::SRV
            )),
            data(&ask(&z, name, RecordType::SRV))
        );
        // Every SRV target resolves to its endpoint.
        assert_eq!(
            data(&ask(
                &z,
                "web-0.c.web.shop.svc.clusterset.local.",
                RecordType::A
            )),
            ["10.3.0.9"]
        );
        assert_eq!(
            data(&ask(
                &z,
                "10-1-0-7.a.web.shop.svc.clusterset.local.",
                RecordType::A
            )),
            ["10.1.0.7"]
        );
        assert_eq!(
            ask(&z, "web-0.a.web.shop.svc.clusterset.local.", RecordType::A),
            Answer::NxDomain,
            "web-0 is c's, not a's"
        );
    }

    #[test]
    fn a_service_with_clusterset_ips_answers_them_and_srv_points_at_the_service() {
        let ips = BTreeMap::from([(
            ("shop".to_owned(), "web".to_owned()),
            vec![
                "10.96.0.20".parse().expect("ip"),
                "fd00::20".parse().expect("ip"),
            ],
        )]);
        let z = zone(&[record("a", "a", &[("10.1.0.7", None, true)])], &ips);
        let name = "web.shop.svc.clusterset.local.";
        assert_eq!(data(&ask(&z, name, RecordType::A)), ["10.96.0.20"]);
        assert_eq!(data(&ask(&z, name, RecordType::AAAA)), ["fd00::20"]);
        assert_eq!(
            data(&ask(&z, name, RecordType::SRV)),
            ["0 100 80 web.shop.svc.clusterset.local."]
        );
    }

    #[test]
    fn unknown_names_are_nxdomain_names_above_services_nodata_and_other_zones_refused() {
        let z = zone(
            &[record("a", "a", &[("10.1.0.7", None, true)])],
            &BTreeMap::new(),
        );
        for name in [
            "db.shop.svc.clusterset.local.",
            "web.other.svc.clusterset.local.",
        ] {
            assert_eq!(ask(&z, name, RecordType::A), Answer::NxDomain, "{name}");
        }
        for name in [
            "shop.svc.clusterset.local.",
            "svc.clusterset.local.",
            "a.web.shop.svc.clusterset.local.",
        ] {
            assert_eq!(
                ask(&z, name, RecordType::A),
                Answer::Records(Vec::new()),
                "{name}"
            );
        }
        assert_eq!(
            ask(&z, "web.shop.svc.clusterset.local.", RecordType::AAAA),
            Answer::Records(Vec::new()),
            "an IPv4-only service has no AAAA"
        );
        assert_eq!(
            ask(&z, "web.shop.svc.cluster.local.", RecordType::A),
            Answer::Refused
        );
        let Answer::Records(apex) = ask(&z, "clusterset.local.", RecordType::SOA) else {
            panic!("the apex answers its SOA");
        };
        assert_eq!(apex, vec![z.soa().clone()]);
    }

    #[test]
    fn an_empty_zone_knows_no_service() {
        let z = zone(&[], &BTreeMap::new());
        assert!(z.is_empty());
        assert_eq!(
            ask(&z, "web.shop.svc.clusterset.local.", RecordType::A),
            Answer::NxDomain
        );
    }
}
