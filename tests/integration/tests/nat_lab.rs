//! The NAT lab's routers (issue 36 item 5) behave as their names say, with real datagrams
//! through real nftables NAT in namespaces, before any test relies on them: a socket on the
//! WireGuard port behind each kind of router sends to two servers at different addresses,
//! which report where they saw it; then the first server's address from another port, and an
//! address the socket never sent to, each send to that mapping.
//!
//! | kind | same mapping for both servers | other port of a contacted address | stranger |
//! |---|---|---|---|
//! | none | yes (the uplink itself) | passes | passes |
//! | one-to-one | yes (the public address, port kept) | passes | passes |
//! | easy | yes (the public address, another port) | passes | dropped |
//! | hard | no (a new port per destination) | dropped | dropped |
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`; CI runs as root and
//! fails instead.

use std::net::SocketAddr;

use trellis_netlab::nat::Behaviour;
use trellis_netlab::{NatKind, Topology};

const PORT: u16 = 51840;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_router_maps_and_filters_as_its_kind_says() {
    if !trellis_netlab::netns::can_run("nat_lab", &["ip", "nft"]) {
        return;
    }
    let names = ["none", "one", "easy", "hard", "s1", "s2", "s3"];
    let sites: Vec<(&str, &str)> = names.iter().map(|n| (*n, "10.0.0.0/16")).collect();
    let mut topology = Topology::build(&sites).expect("topology");
    let mut routers = Vec::new();
    for (i, kind) in NatKind::ALL.into_iter().enumerate() {
        routers.push(topology.add_nat(i, kind, PORT).expect("router"));
    }
    for server in 4..7 {
        topology
            .add_nat(server, NatKind::None, PORT)
            .expect("the public network on the servers");
    }
    let at = |site: usize, port: u16| {
        let s = &topology.sites[site];
        (s.gw_ns.clone(), SocketAddr::new(s.uplink_ip.into(), port))
    };
    let (first, second, stranger) = (at(4, 7000), at(5, 7000), at(6, 7000));
    let mut table = String::from("| kind | first saw | second saw | other port | stranger |\n");
    for router in &routers {
        let site = topology.sites[router.site].clone();
        let seen = router
            .probe(
                &site,
                (&first.0, first.1),
                7001,
                (&second.0, second.1),
                (&stranger.0, stranger.1),
            )
            .await
            .unwrap_or_else(|e| panic!("probing the {} router: {e:#}", router.kind));
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            router.kind,
            seen.mapped_first,
            seen.mapped_second,
            seen.same_address_other_port,
            seen.other_address
        ));
        check(router.kind, router.public_ip.into(), &seen);
    }
    eprintln!("{table}");
}

fn check(kind: NatKind, public: std::net::IpAddr, seen: &Behaviour) {
    assert_eq!(
        seen.mapped_first.ip(),
        public,
        "{kind}: the first server saw {seen:?}"
    );
    let (independent, other_port, stranger) = match kind {
        NatKind::None | NatKind::OneToOne => (true, true, true),
        NatKind::Easy => (true, true, false),
        NatKind::Hard => (false, false, false),
    };
    assert_eq!(
        seen.endpoint_independent_mapping(),
        independent,
        "{kind}: mapping {seen:?}"
    );
    assert_eq!(
        seen.same_address_other_port, other_port,
        "{kind}: another port of a contacted address {seen:?}"
    );
    assert_eq!(seen.other_address, stranger, "{kind}: a stranger {seen:?}");
    match kind {
        NatKind::None | NatKind::OneToOne => assert_eq!(seen.mapped_first.port(), PORT),
        NatKind::Easy | NatKind::Hard => assert_ne!(seen.mapped_first.port(), PORT),
    }
}
