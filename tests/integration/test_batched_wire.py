"""Protocol 3 over real TCP against a real main: the version handshake, and jobs and
acknowledgements that travel as batch lines (issue 10, item 4)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from adapters.memory import MemoryAdapter
from broker.jobs import ExecutionMode, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol
from tests.support import FAST, until

POOLED = ExecutionMode.POOLED


class Peer:
    """Reads whole lines, so a test sees how messages were grouped on the wire."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.lines = wire.LineReader(reader)
        self.writer = wire.MessageWriter(writer)

    @classmethod
    async def connect(cls, port: int) -> Peer:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def read(self) -> protocol.Message | None:
        return await asyncio.wait_for(wire.read_message(self.lines), 10)

    async def hello(self, **fields: Any) -> protocol.Message | None:
        assert isinstance(await self.read(), protocol.Challenge)
        await self.writer.send(protocol.Hello(**fields))
        return await self.read()

    async def close(self) -> None:
        await self.writer.close(grace=1)


async def _main(store: MemoryAdapter) -> Main:
    main = Main(store, MainSettings(**FAST.__dict__))
    await main.start()
    return main


async def test_a_version_2_peer_is_told_which_version_the_main_speaks() -> None:
    main = await _main(MemoryAdapter())
    peer = await Peer.connect(main.port)
    try:
        reply = await peer.hello(role=protocol.Role.CLIENT, protocol=2)
        assert isinstance(reply, protocol.Error), reply
        assert reply.code == protocol.ErrorCode.PROTOCOL_VERSION and reply.fatal
        assert reply.message == f"this main speaks protocol {protocol.PROTOCOL_VERSION}, not 2"
        assert await peer.read() is None, "the main closes after a fatal error"
    finally:
        await peer.close()
        await main.stop()


async def test_a_newer_peer_gets_the_newest_version_both_speak() -> None:
    main = await _main(MemoryAdapter())
    peer = await Peer.connect(main.port)
    try:
        newest = protocol.PROTOCOL_VERSION + 1
        reply = await peer.hello(
            role=protocol.Role.CLIENT,
            protocol=newest,
            protocols=[protocol.PROTOCOL_VERSION, newest],
        )
        assert isinstance(reply, protocol.Welcome), reply
        assert reply.protocol == protocol.PROTOCOL_VERSION
    finally:
        await peer.close()
        await main.stop()


async def test_the_jobs_of_one_pass_and_their_acks_travel_as_one_line_each() -> None:
    store = MemoryAdapter()
    specs = [JobSpec(task="t.noop", args=[n]) for n in range(5)]
    enqueued = [r.job for r in await store.enqueue_many(specs)]
    main = await _main(store)
    peer = await Peer.connect(main.port)
    try:
        welcome = await peer.hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id="batch-worker",
            modes=[POOLED],
        )
        assert isinstance(welcome, protocol.Welcome)
        peer.lines.max_line_bytes = welcome.max_line_bytes
        # The jobs wait in the store, so the first pass after this ready claims them all.
        await peer.writer.send(protocol.Ready(slots={POOLED: 5}, seen=0))
        line = await peer.read()
        assert isinstance(line, protocol.Jobs), line
        jobs = line.jobs
        assert [job.seq for job in jobs] == [1, 2, 3, 4, 5]
        assert {job.job_id for job in jobs} == {job.id for job in enqueued}

        await peer.writer.send(
            protocol.Reports(
                [
                    protocol.CompletedReport(job.job_id, job.handoff_id, result=n)
                    for n, job in enumerate(jobs)
                ]
            )
        )
        acked: list[protocol.ReportAck] = []
        while len(acked) < len(jobs):
            msg = await peer.read()
            assert msg is not None
            acked.extend(m for m in codec.unbatch(msg) if isinstance(m, protocol.ReportAck))
        assert {(a.job_id, a.status) for a in acked} == {
            (job.job_id, protocol.AckStatus.APPLIED) for job in jobs
        }

        async def all_completed() -> bool:
            found = [await store.get_job(job.id) for job in enqueued]
            return all(j is not None and j.status is JobStatus.COMPLETED for j in found)

        await until(all_completed)
    finally:
        await peer.close()
        await main.stop()


async def test_one_stale_report_in_a_batch_spoils_none_of_the_others() -> None:
    store = MemoryAdapter()
    [result] = await store.enqueue_many([JobSpec(task="t.noop")])
    main = await _main(store)
    peer = await Peer.connect(main.port)
    try:
        welcome = await peer.hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id="batch-worker",
            modes=[POOLED],
        )
        assert isinstance(welcome, protocol.Welcome)
        await peer.writer.send(protocol.Ready(slots={POOLED: 1}, seen=0))
        job = await peer.read()
        assert isinstance(job, protocol.JobHandoff), job
        forged = protocol.CompletedReport(job.job_id, uuid.uuid4())  # a lease never issued
        await peer.writer.send(
            protocol.Reports([forged, protocol.CompletedReport(job.job_id, job.handoff_id)])
        )
        statuses: dict[uuid.UUID, protocol.AckStatus] = {}
        while len(statuses) < 2:
            msg = await peer.read()
            assert msg is not None
            for ack in codec.unbatch(msg):
                if isinstance(ack, protocol.ReportAck):
                    statuses[ack.handoff_id] = ack.status
        assert statuses == {
            forged.handoff_id: protocol.AckStatus.STALE,
            job.handoff_id: protocol.AckStatus.APPLIED,
        }
        stored = await store.get_job(result.job.id)
        assert stored is not None and stored.status is JobStatus.COMPLETED
    finally:
        await peer.close()
        await main.stop()
