"""Fair shares between the fairness ids of a tier, on a fake clock (no network)."""

from __future__ import annotations

import asyncio
import hashlib
import statistics
from collections import Counter
from collections.abc import Mapping

import httpx
import pytest

from app.admission.auth import Authenticator
from app.admission.fairshare import FairShare
from app.admission.ticket import Ticket
from app.api.errors import InvalidRequest
from app.api.protocol import fairness_id
from app.fleet.lease import Lease
from app.settings import ApiKeySpec, Settings
from bench.fake_worker import FakeWorker, WorkerConfig
from bench.worker_http import bound_port
from tests.conftest import FakeClock
from tests.fake_upstream import MODEL
from tests.servers import running_gateway, settings_for
from tests.test_admission import _controller, _decisions, _ticket


def _keyed(settings: Settings, clock: FakeClock, fid: str, weight: float = 1.0) -> Ticket:
    ticket = _ticket(settings, clock, "standard")
    ticket.fairness, ticket.weight = fid, weight
    return ticket


class Fleet:
    """An admission controller with ``slots`` running slots and the requests it holds."""

    def __init__(self, slots: int, **overrides: object) -> None:
        self.clock = FakeClock()
        self.admission, self.pool, self.metrics, self.settings = _controller(
            self.clock, max_running_per_worker=slots, initial_running_per_worker=slots,
            **overrides,
        )  # fmt: skip
        self.running: list[tuple[Ticket, Lease]] = []
        self.waiting: list[tuple[Ticket, asyncio.Task[tuple[Lease, float]]]] = []

    async def send(self, fid: str, count: int = 1, weight: float = 1.0) -> None:
        """``count`` requests of ``fid``: those with room run, the others queue."""
        for _ in range(count):
            ticket = _keyed(self.settings, self.clock, fid, weight)
            task = asyncio.create_task(self.admission.admit(ticket))
            self.waiting.append((ticket, task))
        await self.settle()

    async def settle(self) -> None:
        """Let admitted requests take their slots; return who was admitted, in order."""
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        still = []
        for ticket, task in self.waiting:
            if task.done():
                self.running.append((ticket, task.result()[0]))
            else:
                still.append((ticket, task))
        self.waiting = still

    async def finish(self, index: int = 0) -> str:
        """The running request at ``index`` ends; the freed slot goes to whoever is next."""
        ticket, lease = self.running.pop(index)
        lease.release(self.clock.now)
        self.admission.finished(ticket)
        self.admission.dispatch()
        before = len(self.running)
        await self.settle()
        taken = self.running[before:]
        assert len(taken) <= 1
        return taken[0][0].fairness if taken else ""

    def running_by_id(self) -> Counter[str]:
        return Counter(ticket.fairness for ticket, _ in self.running)

    async def close(self) -> None:
        for _, task in self.waiting:
            task.cancel()
        await asyncio.gather(*(t for _, t in self.waiting), return_exceptions=True)


async def test_a_light_key_is_served_before_a_flooding_one_takes_more() -> None:
    fleet = Fleet(slots=8)
    # The flood takes every slot and queues 40 more; then the light key sends 4.
    await fleet.send("flood", 48)
    await fleet.send("light", 4)
    assert fleet.running_by_id() == {"flood": 8}
    # Each slot that comes free goes to the light key until it holds as many as its share.
    got = [await fleet.finish() for _ in range(6)]
    assert got == ["light"] * 4 + ["flood"] * 2
    assert _decisions(fleet.metrics, "standard", "queued") == 44
    await fleet.close()


async def test_below_saturation_nothing_waits_whoever_sends() -> None:
    fleet = Fleet(slots=64)
    await fleet.send("flood", 40)
    await fleet.send("light", 4)
    assert fleet.running_by_id() == {"flood": 40, "light": 4}
    assert not fleet.waiting
    assert _decisions(fleet.metrics, "standard", "queued") == 0
    await fleet.close()


async def test_one_ids_own_requests_and_ids_at_equal_share_go_by_deadline() -> None:
    fleet = Fleet(slots=2)
    await fleet.send("a")
    await fleet.send("b")
    await fleet.send("a", 2)
    await fleet.send("b", 2)
    # Equal shares (one running each): earliest deadline first, whoever it is.
    queued = sorted(fleet.waiting, key=lambda item: item[0].deadline)
    order = [ticket.fairness for ticket, _ in queued]
    first = queued[0][0]
    assert await fleet.finish(0) == first.fairness
    assert fleet.running[-1][0] is first
    # Among one id's own requests, its earliest deadline goes first.
    mine = [t for t, _ in queued if t.fairness == "a"]
    assert mine == sorted(mine, key=lambda t: (t.deadline, t.seq))
    assert order.count("a") == order.count("b") == 2
    await fleet.close()


@pytest.mark.parametrize("keys", [2, 10])
async def test_weighted_ids_get_slots_in_proportion_to_their_weights(keys: int) -> None:
    weights = {f"k{w}": float(w) for w in range(1, keys + 1)}
    slots = int(sum(weights.values()))
    fleet = Fleet(slots=slots)
    for fid, weight in weights.items():
        await fleet.send(fid, 20, weight)
    # The first to send took the slots (nothing waited then), first come first served; the
    # slots that come free go by weight, until the running are in proportion to the weights.
    assert sum(fleet.running_by_id().values()) == slots
    assert fleet.running_by_id()["k1"] >= min(20, slots)
    admitted: Counter[str] = Counter()
    for turn in range(25 * slots):
        # Requests of one length: the oldest running ends first.
        ended = fleet.running[0][0].fairness
        fid = await fleet.finish(0)
        if turn >= 5 * slots:
            admitted[fid] += 1
        await fleet.send(ended, 1, weights[ended])  # each id keeps 20 requests: backlogged
    assert fleet.running_by_id() == {fid: int(w) for fid, w in weights.items()}
    total = sum(admitted.values())
    for fid, weight in weights.items():
        share = weight / sum(weights.values())
        assert admitted[fid] / total == pytest.approx(share, rel=0.10), (fid, admitted)
    await fleet.close()


async def test_a_key_going_quiet_leaves_the_slots_to_the_others() -> None:
    fleet = Fleet(slots=4)
    await fleet.send("a", 2)
    await fleet.send("b", 2)
    await fleet.send("a", 6)
    # b sends no more: its slots, as they come free, go to a's queue.
    got = [await fleet.finish(0) for _ in range(4)]
    assert got == ["a"] * 4
    assert fleet.running_by_id() == {"a": 4}
    await fleet.close()


class Elsewhere:
    """Another process's running requests per id, as if read from Redis."""

    def __init__(self, counts: Mapping[str, int]) -> None:
        self.counts = dict(counts)
        self.fresh = True

    def running(self, priority: int, now: float) -> Mapping[str, int]:
        return self.counts if self.fresh else {}


async def test_the_fleets_shares_order_the_queue_and_its_own_when_redis_is_away() -> None:
    fleet = Fleet(slots=2)
    await fleet.send("a")
    await fleet.send("b")
    await fleet.send("a")
    await fleet.send("b")
    # Another process runs 5 of b's: a is under its share fleet-wide, and goes first.
    elsewhere = Elsewhere({"b": 5})
    fleet.admission.shares.fleet = elsewhere
    tickets = [t for t, _ in fleet.waiting]
    order = list(fleet.admission.shares.order(tickets, fleet.clock.now))
    assert [t.fairness for t in order] == ["a", "b"]
    # The reading goes stale (Redis away): the process's own counts, then deadlines.
    elsewhere.fresh = False
    order = list(fleet.admission.shares.order(tickets, fleet.clock.now))
    assert order == sorted(tickets, key=lambda t: (t.deadline, t.seq))
    await fleet.close()


def test_the_queue_ahead_of_a_light_ids_request_is_its_turn_not_the_whole_flood() -> None:
    clock = FakeClock()
    settings = settings_for("http://a:1")
    shares = FairShare()
    for _ in range(40):
        shares.enqueued(_keyed(settings, clock, "flood"), 1)
    light = _keyed(settings, clock, "light")
    assert shares.ahead(light) == 1  # one of the flood's, then its own turn
    shares.enqueued(_keyed(settings, clock, "light"), 1)
    assert shares.ahead(light) == 3
    assert shares.ahead(_keyed(settings, clock, "flood")) == 41
    alone = FairShare()
    alone.enqueued(_keyed(settings, clock, ""), 1)
    assert alone.ahead(_keyed(settings, clock, "")) == 1  # one id: its whole queue


async def test_the_fairness_gauges_count_waiting_ids_and_the_top_ones_share() -> None:
    fleet = Fleet(slots=4)
    await fleet.send("flood", 4)
    await fleet.send("flood", 2)
    await fleet.send("light", 1)
    fleet.admission.shares.export(fleet.metrics, fleet.settings.tiers)  # as /metrics does
    samples = {
        s.name: s.value
        for m in fleet.metrics.registry.collect()
        for s in m.samples
        if s.name.startswith("gateway_fairness") and s.labels.get("tier") == "standard"
    }
    assert samples == {"gateway_fairness_waiting_ids": 2, "gateway_fairness_top_share": 1.0}
    await fleet.close()


def _auth(*specs: ApiKeySpec) -> Authenticator:
    settings = settings_for("http://a:1", api_keys=list(specs))
    return Authenticator(settings, FakeClock())


def _spec(key: str, **fields: object) -> ApiKeySpec:
    return ApiKeySpec(sha256=hashlib.sha256(key.encode()).hexdigest(), name=key, **fields)


def test_only_keys_allowed_to_may_set_a_fairness_id() -> None:
    auth = _auth(_spec("platform", sets_fairness_id=True, weight=3), _spec("team"))
    platform = auth.identify("Bearer platform", None, "tenant-7")
    assert (platform.fairness, platform.weight) == ("tenant-7", 3.0)
    assert auth.identify("Bearer platform", None, None).fairness == "platform"
    # A key that may not set one keeps its own: it cannot mint fresh shares.
    team = auth.identify("Bearer team", None, "tenant-8")
    assert (team.fairness, team.weight) == ("team", 1.0)
    # Without keys there is no identity to protect: the header names the share.
    assert _auth().identify(None, None, "tenant-9").fairness == "tenant-9"
    assert _auth().identify(None, None, None).fairness == ""


def test_a_fairness_id_header_is_read_and_checked() -> None:
    headers = {"x-gateway-fairness-id": " tenant-1 "}
    assert fairness_id(headers.get) == "tenant-1"
    both = {"x-gateway-fairness-id": "a", "x-llm-d-inference-fairness-id": "b"}
    assert fairness_id(both.get) == "b"  # llm-d's name wins
    assert fairness_id(dict[str, str]().get) is None
    for bad in ("", "x" * 129, "two words", "caf\u00e9"):
        with pytest.raises(InvalidRequest) as error:
            fairness_id({"x-gateway-fairness-id": bad}.get)
        assert error.value.param == "x-gateway-fairness-id"
        assert error.value.code == "invalid_header_value"


async def test_through_a_real_gateway_the_light_key_waits_a_fraction_of_the_flooders() -> None:
    """The issue's case: two keys of one tier, 8 slots, one keeps 48 streams open, one 4."""
    fake = FakeWorker(WorkerConfig(ttft_ms=20.0, itl_ms=20.0, tokens=12, model=MODEL))
    server = await fake.serve("127.0.0.1", 0)
    keys = {"flood": "sk-fair-flood", "light": "sk-fair-light"}
    specs = [
        {"sha256": hashlib.sha256(k.encode()).hexdigest(), "name": n, "tier": "standard"}
        for n, k in keys.items()
    ]
    settings = settings_for(
        f"http://127.0.0.1:{bound_port(server)}",
        api_keys=specs, max_running_per_worker=8, initial_running_per_worker=8,
    )  # fmt: skip
    waits: dict[str, list[float]] = {name: [] for name in keys}
    try:
        async with running_gateway(settings) as url, httpx.AsyncClient(timeout=30) as client:
            stop = asyncio.get_running_loop().time() + 4.0

            async def stream(name: str) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "stream": True}  # fmt: skip
                headers = {"authorization": f"Bearer {keys[name]}"}
                while asyncio.get_running_loop().time() < stop:
                    async with client.stream(
                        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
                    ) as response:
                        await response.aread()
                        if response.status_code == 200:
                            waits[name].append(float(response.headers["x-gateway-queue-ms"]))

            await asyncio.gather(
                *(stream("flood") for _ in range(48)), *(stream("light") for _ in range(4))
            )
    finally:
        server.close()
        await server.wait_closed()
    flood, light = statistics.median(waits["flood"]), statistics.median(waits["light"])
    # 52 streams on 8 slots: the flood waits its turn many times over; the light key's
    # requests take the next slot that comes free (one request lives ~260 ms).
    assert len(waits["light"]) >= 8
    assert flood > 200.0
    assert light < flood / 3, (light, flood)
