"""How a weight sync travels from the trainer to the rollout engines: one interface, three ways.

    transport.connect(engines)     # once, on every trainer rank (engines: the driver's list, else None)
    count = transport.push(stream) # every trainer rank, with its stream from hf_weight_stream(...,
                                   # destination=transport.destination); returns the tensors each engine loaded
    transport.drop(names)          # every trainer rank, the same names (the driver's pool.dead,
                                   # broadcast): later pushes go to the live engines only

- `InProcessTransport` (colocated engines): every rank holds the full tensors and passes them by
  reference to its own share of the engine.
- `FilesTransport` (a filesystem the trainer and the servers share): rank 0 writes the stream once
  as an HF-style safetensors directory; every engine loads that one directory, concurrently.
- `CollectiveTransport` (servers; gloo on CPU, NCCL on GPU): each pipeline stage's leader
  broadcasts its own stage's tensors to every rank of every engine (rollout/weights/group.py),
  while the driver asks each engine over HTTP to receive and load them. Engine world sizes come
  from the engines themselves.

Like Megatron-Core's resharding (a plan of who sends what, an executor, pluggable transports), the
bridge decides *what* is sent (HF names, gathered tensors, per stage), the transport only *how*.
Producing the stream takes collectives (TP/EP gathers), so every trainer rank consumes its
stream in every transport, tensors or not. A push fails on every rank together: the driver's
outcome is shared before anyone returns.

An engine that died (rollout/pool.py marks it, EngineDied) is dropped on every rank at once, before
the next push: `drop` takes every dead name so far and ignores those already dropped, so the
client can pass `pool.dead` at every sync. The files and in-process transports simply stop
addressing the engine; the collective transport's groups contain the dead engine's ranks, so it
builds fresh ones (the next `generation` of store keys on the same store) among the stage leaders
and the surviving engines' ranks.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Protocol

import torch
import torch.distributed as dist

from megatron_rl.bridge.export import buckets
from megatron_rl.rollout.protocol import (
    EngineDied,
    EngineError,
    EngineUnavailable,
    RolloutEngine,
    WeightStream,
    WeightsNotServed,
)
from megatron_rl.rollout.weights.digest import WeightDigest, digesting
from megatron_rl.rollout.weights.stream import drain
from megatron_rl.rollout.weights.group import GroupSpec, host_store, join_stage_group, send_bucket, send_end


class WeightTransport(Protocol):
    name: str
    # Which trainer ranks' streams carry tensors (weights/stream.py hf_weight_stream's destination).
    destination: str

    def connect(self, engines: list[RolloutEngine] | None) -> None: ...

    def push(self, stream: WeightStream) -> int: ...

    def drop(self, names: Iterable[str]) -> None: ...

    def close(self) -> None: ...


def newly_dead(dropped: set[str], names: Iterable[str] | str) -> list[str]:
    """The names not dropped before, recorded as dropped now (the same on every rank, since every
    rank is given the same names)."""
    names = [names] if isinstance(names, str) else list(names)
    new = [name for name in dict.fromkeys(names) if name not in dropped]
    dropped.update(new)
    return new


def agree(outcome: tuple[int | None, str | None], source: int = 0, *, unserved: bool = False) -> int:
    """The driver's (count, error) on every rank: a push fails everywhere or nowhere. `unserved`:
    an error with a count of None that came from unserved_weights stops the run (WeightsNotServed)."""
    holder = [outcome if dist.get_rank() == source else None]
    dist.broadcast_object_list(holder, src=source)
    count, error = holder[0]
    if error is not None:
        if unserved and error.startswith(UNSERVED):
            raise WeightsNotServed(error)
        raise EngineError(error)
    return count


def outcomes(futures: list[tuple[RolloutEngine, Future]]) -> tuple[list, list[str]]:
    """Every engine's result, and a line per engine that failed (none hidden behind the first)."""
    results, failures = [], []
    for engine, future in futures:
        try:
            results.append(future.result())
        except Exception as exc:  # collected: the caller raises one error naming them all
            failures.append(f"{engine.name}: {exc}")
    return results, failures


def on_every_engine(engines: list[RolloutEngine], method: str, *args) -> list:
    """`engine.method(*args)` on every engine concurrently; every failure named, none hidden."""
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        results, failures = outcomes([(engine, pool.submit(getattr(engine, method), *args)) for engine in engines])
    if failures:
        raise EngineError(f"{method} failed on {len(failures)} of {len(engines)} engines:\n  " + "\n  ".join(failures))
    return results


UNSERVED = "rollout engines do not serve the weights this trainer pushed"


def unserved_weights(engines: list[RolloutEngine], expected: WeightDigest | None) -> str | None:
    """Why some engine does not serve the weights last pushed to it, or None (digest.py): what it
    received must be `expected` (None: no push yet, nothing to compare), and the sum of what it
    serves must not have moved since. Asked before a push (a change since the last one) and
    after it (the push itself)."""
    if expected is None:
        return None
    problems = []
    for engine, report in zip(engines, on_every_engine(engines, "fingerprint")):
        if report is None:  # an engine that cannot tell (SGLang)
            continue
        received = WeightDigest.from_dict(report["received"])
        if received is None or not received.matches(expected):
            problems.append(f"{engine.name} last received {received or 'nothing'}, but this trainer pushed {expected}")
        elif report["served_now"] != report["served_at_push"]:
            problems.append(f"{engine.name}'s weights changed after the push (served sum {report['served_at_push']!r}"
                            f" then, {report['served_now']!r} now)")
    if not problems:
        return None
    return (UNSERVED + "; something else loaded or changed them "
            "(another client of an engine's endpoint, a second job with this job's rollout token, or a failed "
            "load): " + "; ".join(problems) + ". Stopped before training on their rollouts.")


def raise_if_unserved(problem: str | None) -> None:
    """Every rank, with the driver's (or its own) finding: the run stops everywhere or nowhere."""
    if problem is not None:
        raise WeightsNotServed(problem)


def same_count(engines: list[RolloutEngine], counts: list[int]) -> int:
    if len(set(counts)) != 1:
        raise EngineError("engines loaded different tensor counts: "
                          + ", ".join(f"{e.name}={c}" for e, c in zip(engines, counts)))
    if counts[0] == 0:
        raise EngineError("weight update delivered no tensors")
    return counts[0]


class InProcessTransport:
    """Colocated: every trainer rank passes the full tensors to its share of the engine."""

    name = "stream"
    destination = "all"

    def __init__(self):
        self.engine = None
        self.dropped: set[str] = set()
        self.pushed: WeightDigest | None = None  # what this rank last pushed

    def connect(self, engines: list[RolloutEngine] | None) -> None:
        (self.engine,) = engines

    def push(self, stream: WeightStream) -> int:
        """Every rank pushes its own full stream to its own share of the engine, and checks it."""
        if self.engine is None:
            raise EngineDied(f"weight push (stream): the colocated engine {', '.join(sorted(self.dropped))} died; "
                             "restart the run (it resumes from its last checkpoint)")
        problem, count = unserved_weights([self.engine], self.pushed), 0
        if problem is None:
            digest = WeightDigest()
            count = self.engine.update_weights(digesting(stream, digest))
            self.pushed = digest
            problem = unserved_weights([self.engine], digest)
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        raise_if_unserved(next((problem for problem in problems if problem), None))
        return count

    def drop(self, names: Iterable[str]) -> None:
        newly_dead(self.dropped, names)
        if self.engine is not None and self.engine.name in self.dropped:
            self.engine = None

    def close(self) -> None:
        pass


class FilesTransport:
    """Rank 0 writes one safetensors directory per push; every engine loads it; it is deleted."""

    name = "files"
    destination = "main"

    def __init__(self, staging_dir: str | Path, bucket_bytes: int):
        self.staging_dir, self.bucket_bytes = Path(staging_dir), bucket_bytes
        self.engines: list[RolloutEngine] | None = None
        self.dropped: set[str] = set()
        self._pushes = 0
        self.pushed: WeightDigest | None = None  # the driver's: what the engines last got

    def connect(self, engines: list[RolloutEngine] | None) -> None:
        self.engines = engines

    def drop(self, names: Iterable[str]) -> None:
        """Every rank (only the driver holds engines): later pushes skip the named engines."""
        newly_dead(self.dropped, names)
        if self.engines is not None:
            self.engines = [engine for engine in self.engines if engine.name not in self.dropped]

    def push(self, stream: WeightStream) -> int:
        if self.engines is None:
            drain(stream)
            return agree((None, None))
        self._pushes += 1
        directory = self.staging_dir / f"push-{self._pushes:06d}"
        outcome: tuple[int | None, str | None]
        try:
            if not self.engines:
                drain(stream)  # the other ranks' streams take part in its collectives
                raise EngineUnavailable(f"no live engine left (dead: {', '.join(sorted(self.dropped))})")
            problem = unserved_weights(self.engines, self.pushed)
            if problem is None:
                digest = WeightDigest()
                written = write_safetensors_dir(digesting(stream, digest), directory, self.bucket_bytes)
                counts = on_every_engine(self.engines, "load_weight_files", str(directory))
                count = same_count(self.engines, counts)
                if count != written:
                    raise EngineError(f"engines loaded {count} tensors of the {written} written to {directory}")
                self.pushed = digest
                problem = unserved_weights(self.engines, digest)
            else:
                drain(stream)
            outcome = (count if problem is None else None, problem)
        except EngineError as exc:
            outcome = (None, f"weight push (files, {directory}): {exc}")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return agree(outcome, unserved=True)

    def close(self) -> None:
        pass


def write_safetensors_dir(stream: WeightStream, directory: Path, bucket_bytes: int) -> int:
    """The stream as `model-NNNNN.safetensors` files plus `model.safetensors.index.json` (the HF
    layout, which every engine's loader reads); returns the number of tensors written."""
    from safetensors.torch import save_file

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for index, bucket in enumerate(buckets(stream, bucket_bytes)):
        file_name = f"model-{index:05d}.safetensors"
        tensors = {}
        for name, tensor in bucket:
            tensor = tensor.detach()
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                tensor = tensor.to("cpu").contiguous()
            tensors[name] = tensor
            weight_map[name] = file_name
            total += tensor.numel() * tensor.element_size()
        try:
            save_file(tensors, str(directory / file_name))
        except RuntimeError:
            # safetensors refuses tensors that share storage (tied weights): copy those.
            save_file({name: tensor.clone() for name, tensor in tensors.items()}, str(directory / file_name))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return len(weight_map)


class CollectiveTransport:
    """Each pipeline stage's leader broadcasts its stage's buckets to every engine rank.

    A bucket goes as two broadcasts over the stage's group: a header (JSON metadata length,
    payload length) and one uint8 buffer holding the metadata then every tensor's bytes; a
    header of zeros ends the stage. The engines learn each bucket's contents in-band, so nothing
    is planned ahead and a changed model cannot desynchronize the two sides."""

    name = "collective"
    destination = "leaders"

    def __init__(self, *, host: str, backend: str, bucket_bytes: int, timeout_s: float, port: int):
        self.host, self.backend, self.bucket_bytes = host, backend, bucket_bytes
        self.timeout_s, self.port = timeout_s, port
        self.engines: list[RolloutEngine] | None = None
        self.dropped: set[str] = set()
        self._sizes: dict[str, int] = {}  # engine name -> its ranks (the driver's)
        self.group = None
        self._store = None
        self._stage, self._leader = _stage_and_leader()
        self.spec: GroupSpec | None = None
        self.pushed: WeightDigest | None = None  # the driver's: what the stage leaders last sent, together

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def connect(self, engines: list[RolloutEngine] | None) -> None:
        """Every rank. The driver asks the engines for their world sizes and hosts the store;
        stage leaders and engines then join their groups together."""
        self.engines = engines
        outcome = None
        if engines is not None:
            try:
                sizes = on_every_engine(engines, "weight_receivers")
                self._sizes = {engine.name: size for engine, size in zip(engines, sizes)}
                stages = _pipeline_stages()
                self._store = host_store(self.host, self.port, self.timeout_s)
                spec = GroupSpec(self.host, self.port, 1 + sum(sizes), stages, self.backend, self.timeout_s)
                outcome = (spec.to_json(), None)
            except EngineError as exc:
                outcome = (None, f"weight transport (collective): {exc}")
        self._join(outcome)

    def drop(self, names: Iterable[str]) -> None:
        """Every rank together, with the same names (the driver's pool.dead, broadcast). The groups
        hold the dead engines' ranks, so for any name not dropped before, every stage leader and
        every surviving engine rank join fresh groups: the next generation of store keys on the
        same store, survivors renumbered. Names dropped before are ignored (then nothing is
        collective). Must run before the next push: a push into a group with a dead rank fails
        only at the group's timeout."""
        new = newly_dead(self.dropped, names)
        if not new:
            return
        outcome = None
        if self.engines is not None:
            unknown = [name for name in new if name not in self._sizes]
            self.engines = [engine for engine in self.engines if engine.name not in self.dropped]
            if unknown:
                outcome = (None, f"weight transport (collective): no engine named {', '.join(unknown)} to drop")
            elif not self.engines:
                outcome = (None, f"weight transport (collective): no live engine left "
                                 f"(dead: {', '.join(sorted(self.dropped))})")
            else:
                world = 1 + sum(self._sizes[engine.name] for engine in self.engines)
                outcome = (replace(self.spec, world_size=world, generation=self.spec.generation + 1).to_json(), None)
        self.group = None  # holds the dead ranks; the engines' workers replace theirs when they join
        self._join(outcome, error_type=EngineUnavailable)

    def _join(self, outcome: tuple[str | None, str | None] | None, error_type: type[EngineError] = EngineError) -> None:
        """Every rank: the driver's (spec, error) is shared; then every live engine's ranks (through
        the driver) and every stage leader join the spec's groups together."""
        holder = [outcome]
        dist.broadcast_object_list(holder, src=0)
        spec_json, error = holder[0]
        if error is not None:
            raise error_type(error)
        self.spec = GroupSpec.from_json(spec_json)
        joining = None
        if self.engines is not None:
            offsets = [1 + sum(self._sizes[e.name] for e in self.engines[:index]) for index in range(len(self.engines))]
            pool = ThreadPoolExecutor(max_workers=len(self.engines))
            joining = [(engine, pool.submit(engine.join_weight_group, spec_json, offset))
                       for engine, offset in zip(self.engines, offsets)]
        error = None
        try:
            if self._leader:
                self.group = join_stage_group(self.spec, self._stage, 0, store=self._store)
        except Exception as exc:  # reported with the engines' side of the story below
            error = f"stage {self._stage} leader could not join the weight group at {self.host}:{self.port}: {exc}"
        if joining is not None:
            _, failures = outcomes(joining)
            pool.shutdown()
            if failures:
                error = (error + "; " if error else "") + "engines failed to join: " + "; ".join(failures)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error)
        problems = [problem for problem in everyone if problem]
        if problems:
            raise EngineError(f"weight transport (collective, {self.backend}): " + " | ".join(problems))

    def push(self, stream: WeightStream) -> int:
        # Changed since the last push? Asked before the engines start receiving.
        holder = [unserved_weights(self.engines, self.pushed) if self.engines else None]
        dist.broadcast_object_list(holder, src=0)
        if holder[0] is not None:
            drain(stream)
            raise_if_unserved(holder[0])
        receiving = None
        if self.engines is not None:
            pool = ThreadPoolExecutor(max_workers=len(self.engines))
            receiving = [(engine, pool.submit(engine.receive_weights)) for engine in self.engines]
        sent, error, digest = 0, None, WeightDigest()
        try:
            if self._leader:
                sent = self._send(digesting(stream, digest))
            else:
                drain(stream)
        except Exception as exc:
            error = f"stage {self._stage} leader failed while sending: {exc}"
        # Every leader's count and digest: the engines must have loaded their sum.
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self._leader, sent, error, digest.to_dict()))
        total = sum(count for leader, count, _, _ in everyone if leader)
        errors = [problem for _, _, problem, _ in everyone if problem]
        outcome: tuple[int | None, str | None] = (None, None)
        if receiving is not None:
            counts, failures = outcomes(receiving)
            pool.shutdown()
            try:
                if errors or failures:
                    raise EngineError("; ".join(errors + failures))
                count = same_count(self.engines, counts)
                if count != total:
                    raise EngineError(f"engines loaded {count} tensors, the stage leaders sent {total}")
                self.pushed = WeightDigest()
                for leader, _, _, sent_digest in everyone:
                    if leader:
                        self.pushed = self.pushed.merged(WeightDigest(**sent_digest))
                problem = unserved_weights(self.engines, self.pushed)
                outcome = (count if problem is None else None, problem)
            except EngineError as exc:
                outcome = (None, f"weight push (collective, {self.backend}): {exc}")
        return agree(outcome, unserved=True)

    def _send(self, stream: WeightStream) -> int:
        sent = 0
        for bucket in buckets(stream, self.bucket_bytes):
            send_bucket(self.group, bucket, self.device)
            sent += len(bucket)
        send_end(self.group, self.device)
        return sent

    def close(self) -> None:
        self.group = None
        self._store = None


def _stage_and_leader() -> tuple[int, bool]:
    from megatron.core import parallel_state as ps

    from megatron_rl.bridge.export import is_stage_leader

    return ps.get_pipeline_model_parallel_rank(), is_stage_leader()


def _pipeline_stages() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()
