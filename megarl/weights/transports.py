"""How buckets reach the rollout servers. One transport instance per trainer rank; only the
stage source ranks (DP=0, TP=0 of each pipeline stage) send anything.

- :class:`DistributedTransport`: a weight-update group per stage source (the source is rank 0,
  server i is rank 1+i), made through the servers' ``/init_weights_update_group`` and
  :func:`megarl.common.net.new_process_group` (the servers join with the same function); per bucket,
  announce names/dtypes/shapes over HTTP and broadcast the tensors. NCCL on GPU, gloo on CPU.
  Groups are created stage by stage, so sources never deadlock.
- :class:`DiskTransport`: HF safetensors written atomically to a shared directory (one
  subdirectory per version), then every server reloads it (clusters with no common network group).
- :class:`TensorTransport`: each bucket in the body of an HTTP call (small models, tests), as
  base64 safetensors (megarl-server) or in SGLang's format (real SGLang).
"""
from __future__ import annotations

import os
import secrets
import shutil
from typing import ClassVar, Optional, Protocol

import torch
import torch.distributed as dist

from megarl.common.net import listening_socket, new_process_group
from megarl.common.net import advertised_address, url_host
from megarl.protocol.wire import (DIRECT_BUCKET, FLAT_ALIGN, FLATTENED_BUCKET, DiskWeightsUpdate,
                                  DistributedWeightsMeta, WeightsUpdateGroup, direct_split, flat_layout,
                                  sglang_flat_order, TensorWeightsUpdate)
from megarl.protocol.channel import ManagerStalled
from megarl.protocol.messages import (DestroyWeightsGroup, InitWeightsGroup, UpdateFromDisk, UpdateFromDistributed,
                                      UpdateFromTensor)
from megarl.weights.resharder import Bucket
from megarl.weights.target import StageAdmin
from megarl.protocol.tensor_wire import WireFormat, tensor_update


class PushError(RuntimeError):
    """A push step failed; the message names the step and the server(s)."""


class Transport(Protocol):
    """What `megarl.weights.push.WeightPusher` needs of a transport (one per trainer rank)."""

    # True: step 2 hands the resharder's buckets to send() (the pusher pipelines them and records
    # their checksums); False: finish() writes whole checkpoints itself and send() is never called
    streams_buckets: ClassVar[bool]

    def setup(self, stage: int) -> None: ...  # stage source, once per server set

    def send(self, bucket: Bucket, version: str) -> None: ...  # stage source, one bucket

    def finish(self, version: str, engine) -> None: ...  # every rank, after every stage sent

    def close(self) -> None: ...


class DistributedTransport:
    """``wire`` "megarl" (megarl-server, load_format "direct_bucket"): a broadcast per large tensor
    and one for all the small ones, instead of one per tensor: a collective's fixed latency (~1 ms
    on loopback gloo) times ~40 small tensors was most of a small model's push, and packing the
    large ones too cost a memcpy on each side. "sglang" (SGLang 0.5.x, load_format
    "flattened_bucket"): the whole bucket in one broadcast, laid out back to back as SGLang's
    receiver expects (`megarl.protocol.wire.sglang_flat_order` keeps every tensor aligned); megarl-server
    takes it too, so a mixed server set uses it."""

    streams_buckets = True

    def __init__(self, admin: StageAdmin, master_address: str, timeout_s: float, backend: str,
                 wire: WireFormat = "megarl"):
        self.admin, self.addr, self.timeout_s, self.backend = admin, master_address, timeout_s, backend
        self.wire = wire
        self._packbuf = torch.empty(0, dtype=torch.uint8)
        self.group = None
        self.group_name = ""

    def setup(self, stage: int) -> None:
        """Source rank of ``stage``: host a group and have every server join it. Stages may sit on
        different nodes, so each source advertises its own address (weights.master_address, or
        for "auto" the address its route to the servers leaves from) and a free port of it."""
        # a name of this run's: a group a crashed run left registered on an external server (the
        # server keeps it until destroyed) must not block the next run's, fresh or resumed
        self.group_name = f"megarl-weights-pp{stage}-{secrets.token_hex(4)}"
        addr = advertised_address(self.addr, url_host(self.admin.addresses[0]))
        listener = listening_socket(addr)  # the store below serves on it: this address only
        port = listener.getsockname()[1]
        world = 1 + len(self.admin.addresses)  # the source is rank 0, server i is rank 1 + i
        spec = WeightsUpdateGroup(addr, port, world, self.group_name, "nccl" if self.backend == "nccl" else "gloo",
                                  timeout=self.timeout_s if self.wire == "megarl" else None)
        # the servers' join blocks until we host the store: ask first, then host, then collect
        joined = self.admin.send(InitWeightsGroup(spec))
        try:
            self.group = new_process_group(addr, port, 0, world, self.group_name, spec.backend,
                                          self.timeout_s, listener=listener)
        except Exception as e:  # noqa: BLE001 - the servers' side says why, if they can
            _finish(joined, self.timeout_s, "init_weights_update_group")
            raise PushError(f"init_weights_update_group: rendezvous at {addr}:{port} failed: {e}") from e
        _finish(joined, self.timeout_s, "init_weights_update_group")
        print(f"[weights] stage {stage}: weight-update group {self.group_name} at {addr}:{port}", flush=True)

    def send(self, bucket: Bucket, version: str) -> None:
        """Announce, then broadcast: "megarl" per `megarl.protocol.wire.direct_split`, large tensors
        straight from the resharder's tensors (views of the parameters where no conversion was
        needed) and the small ones packed into one reused buffer; "sglang" the whole bucket packed
        into that buffer in SGLang's order and layout, one broadcast."""
        if self.wire == "megarl":
            order, load_format, align = range(len(bucket.names)), DIRECT_BUCKET, FLAT_ALIGN
        else:
            order, load_format, align = sglang_flat_order(bucket.dtypes), FLATTENED_BUCKET, 1
        names, dtypes = [bucket.names[i] for i in order], [bucket.dtypes[i] for i in order]
        tensors, shapes = [bucket.tensors[i] for i in order], [bucket.shapes[i] for i in order]
        meta = DistributedWeightsMeta(names, dtypes, shapes, self.group_name, flush_cache=False,
                                      load_format=load_format)
        # announce first: the server enters its receive on this request; our broadcasts wait for it
        announced = self.admin.send(UpdateFromDistributed(meta))
        try:
            # NCCL moves CUDA tensors only; gloo moves host memory
            dev = tensors[0].device if self.backend == "nccl" else torch.device("cpu")
            direct, packed = (direct_split(dtypes, shapes) if load_format == DIRECT_BUCKET
                              else ([], list(range(len(names)))))
            # queued without waiting, one wait at the end: the group's worker thread streams them
            # back to back instead of handing each one to and from this thread (a scheduler
            # round trip per tensor, several ms on a loaded host)
            works = [dist.broadcast(tensors[i].to(dev).contiguous(), group=self.group, group_src=0,
                                    async_op=True) for i in direct]
            if packed:
                works.append(dist.broadcast(self._pack([tensors[i] for i in packed], dev, align),
                                            group=self.group, group_src=0, async_op=True))
            _wait_works(works, announced)
        except ManagerStalled:
            raise
        except Exception as e:  # noqa: BLE001
            announced.cancel()  # the server's receive fails on the broken group and answers so
            raise PushError(f"update_weights_from_distributed: broadcast of {names[0]}... "
                            f"failed ({type(e).__name__}: {str(e).splitlines()[0]}); servers "
                            f"{self.admin.addresses}") from e
        if getattr(announced, "deferred", None) is False:
            # through the rollout manager: the load's reply is read at the next push (settle),
            # and the manager publishes the version only after every load finished
            announced.deferred = True
            return
        _finish(announced, self.timeout_s, "update_weights_from_distributed")

    def _pack(self, tensors: list[torch.Tensor], device, align: int) -> torch.Tensor:
        """``tensors`` in `megarl.protocol.wire.flat_layout`, in a buffer kept across buckets and pushes
        (the sends are sequential, and a broadcast returns once its bytes left the buffer)."""
        layout, total = flat_layout([dtype_name(t) for t in tensors], [list(t.shape) for t in tensors], align)
        if self._packbuf.numel() < total or self._packbuf.device != torch.device(device):
            self._packbuf = torch.empty(total, dtype=torch.uint8, device=device)
        buf = self._packbuf[:total]
        for t, (off, n) in zip(tensors, layout):
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
        return buf

    def finish(self, version: str, engine) -> None:
        pass

    def close(self) -> None:
        if self.group is not None:
            leave_update_group(self.admin, self.group, self.group_name, self.timeout_s)
            self.group = None


def post_tensor_update(admin, update: TensorWeightsUpdate, timeout_s: float, where: str = "") -> None:
    """``/update_weights_from_tensor`` on every server; any failure is a PushError naming it."""
    try:
        admin.request(UpdateFromTensor(update), timeout_s)
    except Exception as e:  # noqa: BLE001
        raise PushError(f"update_weights_from_tensor{where}: {e}") from e


def leave_update_group(admin: Optional[StageAdmin], group, name: str, timeout_s: float,
                       tell_servers: bool = True) -> None:
    """Ends a weight-update group: the servers are asked to destroy their side (best effort), then
    this rank's side is destroyed. ``tell_servers``: false on ranks that share a group some other
    rank already announced (shard refit: only TP rank 0 speaks to the servers)."""
    if tell_servers:
        try:
            # short: after a failure the group may include a dead or hung server
            admin.request(DestroyWeightsGroup(name), min(5.0, timeout_s))
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
    dist.destroy_process_group(group)


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


class TensorTransport:
    """``wire``: "megarl" (safetensors) for megarl-server, "sglang" for real SGLang (see
    megarl.protocol.tensor_wire)."""

    streams_buckets = True

    def __init__(self, admin: StageAdmin, timeout_s: float, wire: WireFormat = "megarl"):
        self.admin, self.timeout_s, self.wire = admin, timeout_s, wire

    def setup(self, stage: int) -> None:
        pass

    def send(self, bucket: Bucket, version: str) -> None:
        update = tensor_update(dict(zip(bucket.names, bucket.tensors)), self.wire, flush_cache=False)
        post_tensor_update(self.admin, update, self.timeout_s)

    def finish(self, version: str, engine) -> None:
        pass

    def close(self) -> None:
        pass


def remove_orphans(directory: str, prefix: str) -> list[str]:
    """Handover files of trainers that are gone (SIGKILLed: close() never ran), named
    ``<prefix><pid>-pp<stage>``; a file of a live process, or not of this user, is left alone."""
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        pid = name[len(prefix):].split("-", 1)[0]
        if not (name.startswith(prefix) and pid.isdigit()):
            continue
        path = os.path.join(directory, name)
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal): not an orphan
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


class SharedMemoryTransport:
    """Same host (megarl-server, `weights.transport: shm`): each bucket is copied once into a file
    in /dev/shm that this stage source owns (0600, removed at close) and announced by a JSON
    manifest of names, dtypes, shapes and offsets (`megarl.protocol.wire.SHARED_MEMORY`); the server maps
    the file and loads from it. A trainer killed before close() leaves its file; the next run's
    setup removes the files of processes that are gone (`remove_orphans`). No weight byte crosses a socket: ``socket_bytes`` counts the
    manifests, ``shared_bytes`` the weights."""

    streams_buckets = True
    ALIGN = 64

    def __init__(self, admin: StageAdmin, timeout_s: float):
        self.admin, self.timeout_s = admin, timeout_s
        self.path, self.buf = "", torch.empty(0, dtype=torch.uint8)
        self.fd, self.map = -1, None
        self.shared_bytes = self.socket_bytes = 0

    def setup(self, stage: int) -> None:
        """The file is created here, exclusively (O_EXCL | O_NOFOLLOW, 0600) under a name with 64
        random bits: /dev/shm is writable by every user, and a name planted there in advance (a
        link, a file another user can read) makes the setup fail instead of receiving the weights.
        The sticky bit of /dev/shm keeps others from renaming or removing it afterwards, and the
        trainer writes through its own descriptor only; the name reaches the server in each
        manifest over the keyed channel."""
        from megarl.protocol.wire import SHM_DIR, SHM_PREFIX

        if self.fd >= 0:  # a new server set: the same file serves it
            return
        remove_orphans(SHM_DIR, SHM_PREFIX)
        self.path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-pp{stage}-{secrets.token_hex(8)}")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            path, self.path = self.path, ""  # not ours: close() must not remove it
            raise RuntimeError(f"weights.transport=shm: cannot create {path} ({e.strerror or e})") from None

    def _map(self, nbytes: int) -> torch.Tensor:
        import mmap

        if self.buf.numel() < nbytes:
            self.buf = torch.empty(0, dtype=torch.uint8)
            if self.map is not None:
                try:
                    self.map.close()
                except BufferError:  # a view still alive: the old mapping goes with it
                    pass
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.buf = torch.frombuffer(self.map, dtype=torch.uint8)
        return self.buf

    def send(self, bucket: Bucket, version: str) -> None:
        import json

        from megarl.protocol.wire import SHARED_MEMORY

        offsets, end = [], 0
        for t in bucket.tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        buf = self._map(max(end, 1))
        entries = []
        for name, t, off in zip(bucket.names, bucket.tensors, offsets):
            n = t.numel() * t.element_size()
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)  # the one copy of the handover
            entries.append([name, dtype_name(t), list(t.shape), off])
        manifest = json.dumps({"path": self.path, "tensors": entries})
        update = TensorWeightsUpdate([manifest], SHARED_MEMORY, flush_cache=False)
        self.shared_bytes += sum(t.numel() * t.element_size() for t in bucket.tensors)
        self.socket_bytes += len(manifest)
        post_tensor_update(self.admin, update, self.timeout_s, f" (shm {self.path})")

    def finish(self, version: str, engine) -> None:
        pass

    def close(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a tensor view still alive: the mapping goes with it
                pass
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class DiskTransport:
    """Writes through the engine's HF export (collective, atomic) in :meth:`finish`."""

    streams_buckets = False

    def __init__(self, admin: Optional[StageAdmin], directory: str, keep: int, timeout_s: float, dtype):
        self.admin, self.dir, self.keep, self.timeout_s, self.dtype = admin, directory, keep, timeout_s, dtype

    def setup(self, stage: int) -> None:
        pass

    def send(self, bucket: Bucket, version: str) -> None:
        raise AssertionError("DiskTransport writes whole checkpoints in finish()")

    def finish(self, version: str, engine) -> None:
        # one directory per version, written atomically: a server never reads a half-written one
        path = os.path.join(self.dir, f"v{version}")
        engine.export_hf(path, dtype=self.dtype)
        if dist.get_rank() == 0:
            update = DiskWeightsUpdate(path)
            try:
                self.admin.request(UpdateFromDisk(update), self.timeout_s)
            except Exception as e:  # noqa: BLE001
                raise PushError(f"update_weights_from_disk {path}: {e}") from e
            self._prune(keep_also=path)

    def _prune(self, keep_also: str) -> None:
        versions = sorted((d for d in os.listdir(self.dir) if d.startswith("v") and d[1:].isdigit()),
                          key=lambda d: int(d[1:]))
        for d in versions[:-self.keep]:
            if os.path.join(self.dir, d) != keep_also:
                shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)

    def close(self) -> None:
        pass


def _wait_works(works: list, announced) -> None:
    """The broadcasts of a bucket. Through the rollout manager the servers enter their receive
    only once the manager relayed the announce: while the bytes wait, the manager's link is
    read, so a manager that stopped is reported within its silence window (ManagerStalled),
    not after the group's timeout."""
    link = getattr(announced, "link", None)
    if link is not None:
        link.wait_while(lambda: not all(w.is_completed() for w in works))
    for w in works:
        w.wait()


def _finish(fut, timeout_s: float, step: str):
    """Waits for an admin future; timeouts and server failures become PushError."""
    import concurrent.futures

    try:
        return fut.result(timeout=timeout_s)
    except ManagerStalled:
        raise  # one line of its own, naming the manager and the deadline
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise PushError(f"{step}: no answer within {timeout_s:.0f} s") from None
    except Exception as e:  # noqa: BLE001
        raise PushError(f"{step}: {e}") from e


