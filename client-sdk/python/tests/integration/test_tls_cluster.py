"""Mutual TLS with the cluster's certificates (``cairnctl certs init``): applications attach
to their daemons' TLS application ports presenting their nodes' certificates, and the
coordinator client presents a certificate without a role plus a bearer token
(``cairnctl auth token``) — and each is refused without the right credentials."""

from __future__ import annotations

import json
from collections.abc import Awaitable

import grpc

from cairn import AppSession, CairnError, CoordinatorClient, RpcError, Tls
from cairn.v1 import types_pb2

from .apps import Pump, numbered
from .cluster import Cluster, Harness, local_state, run

#: Messages each way.
N = 2000


def test_applications_and_the_coordinator_client_over_mutual_tls(harness: Harness) -> None:
    async def body() -> None:
        async with await Cluster.start(harness, ["n1", "n2"], secure=True) as cluster:
            security = cluster.security
            assert security is not None
            n1 = cluster.nodes["n1"].app

            # A daemon wants its own node's certificate, over TLS.
            for tls, why in ((security.tls("n2"), "n2's certificate at n1"), (None, "plaintext")):
                try:
                    wrong = await AppSession.connect(n1, "impostor", tls=tls, attach_timeout=5)
                except CairnError as e:
                    print(f"\n{why}: refused: {e}")
                else:
                    await wrong.close(drain=0)
                    raise AssertionError(f"{why} was attached")
            ca_only = Tls.from_files(security.ca)
            try:
                wrong = await AppSession.connect(n1, "no-cert", tls=ca_only, attach_timeout=5)
            except CairnError as e:
                print(f"no client certificate: refused: {e}")
            else:
                await wrong.close(drain=0)
                raise AssertionError("a session without a client certificate was attached")

            a = await cluster.attach("n1", "tls-a", tls=security.tls("n1"))
            b = await cluster.attach("n2", "tls-b", tls=security.tls("n2"))
            assert a.cluster == "cairn" and a.peers == {"n2"} and a.flow_control
            pump_a = Pump(a, state=lambda p: json.dumps({"got": p.count}).encode())
            pump_b = Pump(b, state=lambda p: json.dumps({"got": p.count}).encode())
            await a.send_many([("n2", numbered(i, 100)) for i in range(N)])
            await b.send_many([("n1", numbered(i, 100)) for i in range(N)])
            await pump_b.until("n2 got every message", lambda: pump_b.received_from("n1") == N)
            await pump_a.until("n1 got every message", lambda: pump_a.received_from("n2") == N)

            # The coordinator: n2's certificate names a node and no role, so the token
            # decides (the coordinator's certificate names `coordinator`, not 127.0.0.1).
            node_tls = security.tls("n2")
            async with await CoordinatorClient.connect(cluster.coordinator, tls=node_tls) as c:
                refused = await refusal(c.list_nodes(), "listed the nodes without a token")
                assert refused.code == grpc.StatusCode.UNAUTHENTICATED, refused
            async with await CoordinatorClient.connect(
                cluster.coordinator, tls=node_tls, token="0" * 64
            ) as c:
                refused = await refusal(c.list_nodes(), "listed the nodes with an unknown token")
                assert refused.code == grpc.StatusCode.UNAUTHENTICATED, refused
            async with await CoordinatorClient.connect(
                cluster.coordinator, tls=node_tls, token=security.viewer_token
            ) as viewer:
                nodes = await viewer.list_nodes()
                assert sorted(n.node_id for n in nodes.nodes) == ["n1", "n2"]
                refused = await refusal(viewer.start_snapshot("unaligned"), "a viewer started one")
                assert refused.code == grpc.StatusCode.PERMISSION_DENIED, refused
            async with await CoordinatorClient.connect(
                cluster.coordinator, tls=node_tls, token=security.token
            ) as operator:
                snapshot_id = await operator.start_snapshot("unaligned", labels={"by": "token"})
                ended = await operator.wait_snapshot(snapshot_id)
                assert ended.status == types_pb2.SNAPSHOT_STATUS_COMPLETED, ended
                snapshot = await operator.get_snapshot(snapshot_id, include_data=True)
                assert dict(snapshot.labels) == {"by": "token"}
                got = {n: json.loads(local_state(snapshot, n))["got"] for n in ("n1", "n2")}
                assert got == {"n1": N, "n2": N}, got
            # Without a client certificate the coordinator refuses the connection itself.
            try:
                async with await CoordinatorClient.connect(
                    cluster.coordinator, tls=ca_only, token=security.token, election_wait=1
                ) as c:
                    await c.list_nodes()
                raise AssertionError("the coordinator answered a client without a certificate")
            except CairnError as e:
                print(f"coordinator without a client certificate: {e}")
            await pump_a.stop()
            await pump_b.stop()

    run(body(), timeout=90)


async def refusal(call: Awaitable[object], what: str) -> RpcError:
    """The error ``call`` fails with; fails the test (saying ``what``) if it answers."""
    try:
        await call
    except RpcError as e:
        return e
    raise AssertionError(what)
