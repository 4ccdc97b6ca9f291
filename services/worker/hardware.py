"""The node's hardware, probed once per registration (``WorkerRegistration``).

What the node agent declares to control first on every session: its CUDA devices
(``nvidia-smi``, or torch only when the tool is missing) with where each sits (PCI bus id,
NUMA node and local CPUs, from sysfs), host memory, usable CPUs and the slots it offers.
Reads the OS and the driver, never another module; never raises for a broken driver (the
node then reports no GPU).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import struct
import subprocess

from services.common.cpu_list import format_cpu_list, parse_cpu_list
from services.contract import control_pb2

MEMINFO_ENV = "SURGE_WORKER_MEMINFO"  # tests point it at a file they write
DEFAULT_MEMINFO = "/proc/meminfo"


SYSFS_ENV = "SURGE_WORKER_SYSFS"  # tests point it at a tree they write
DEFAULT_SYSFS = "/sys"


def detect_cuda_devices(sysfs: str = DEFAULT_SYSFS) -> list[control_pb2.Device]:
    """The node's CUDA devices (kind "cuda", physical index, name, memory in bytes, and
    where each sits: PCI bus id, NUMA node, local CPUs).

    Reads ``nvidia-smi`` (fast). Only when it is missing but a driver is present
    (``/dev/nvidiactl``) does it import torch, which costs ~2 s of start-up. A numeric
    ``CUDA_VISIBLE_DEVICES`` restricts the list to those physical indices; rank processes
    get ``CUDA_VISIBLE_DEVICES=<index>`` from the same numbering (``nvidia-smi``'s, which is
    PCI bus order: the ranks get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` to match).

    A device's NUMA node and local CPUs are read from ``<sysfs>/bus/pci/devices/<bus
    id>/numa_node`` and ``local_cpulist`` (what torchrun's ``--numa-binding`` reads,
    ``torch/numa/binding.py``), the CPUs kept to those this agent may use; a node that does
    not say (no file, NUMA node -1) leaves them unset.

    Returns [] when the node has no usable GPU; never raises (a broken driver reports no
    devices rather than stopping the agent).
    """
    devices = _cuda_from_nvidia_smi()
    if devices is None:
        devices = _cuda_from_torch() if os.path.exists("/dev/nvidiactl") else []
    visible = _visible_cuda_indices()
    if visible is not None:
        devices = [d for d in devices if d.index in visible]
    allowed = _allowed_cpus()
    for d in devices:
        _locate(d, sysfs, allowed)
    return devices


def _cuda_from_nvidia_smi() -> list[control_pb2.Device] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,pci.bus_id", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            mib = int(parts[2]) if parts[2].isdigit() else 0
            devices.append(
                control_pb2.Device(
                    kind="cuda",
                    index=int(parts[0]),
                    name=parts[1],
                    memory_bytes=mib * 2**20,
                    pci_bus_id=sysfs_bus_id(parts[3]) or "",
                )
            )
    return devices


def sysfs_bus_id(bus_id: str) -> str | None:
    """A PCI bus id as sysfs names its directory: nvidia-smi's "00000000:1B:00.0" (and
    torch's "0000:1b:00.0") -> "0000:1b:00.0". None when it is not one."""
    m = re.fullmatch(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])", bus_id.strip())
    if m is None:
        return None
    domain, bus, device, function = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def _locate(device: control_pb2.Device, sysfs: str, allowed: set[int] | None) -> None:
    """Fill ``numa_node`` and ``cpu_list`` of ``device`` from sysfs (where it says)."""
    if not device.pci_bus_id:
        return
    where = os.path.join(sysfs, "bus", "pci", "devices", device.pci_bus_id)
    try:
        with open(os.path.join(where, "numa_node")) as f:
            node = int(f.read().strip())
        if node >= 0:  # -1: the platform has no NUMA information for this device
            device.numa_node = node
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(where, "local_cpulist")) as f:
            cpus = parse_cpu_list(f.read())
    except (OSError, ValueError):
        return
    if allowed is not None:  # (a cpuset or taskset narrows what its ranks may run on)
        cpus = [c for c in cpus if c in allowed]
    device.cpu_list = format_cpu_list(cpus)


def _cuda_from_torch() -> list[control_pb2.Device]:
    try:
        import torch  # lazy: ~2 s, only on a GPU node without nvidia-smi
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [int(x) for x in visible.split(",")] if visible and _is_index_list(visible) else None
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        index = physical[i] if physical and i < len(physical) else i
        try:  # as torch/numa/binding.py formats it
            bus_id = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        except (AttributeError, TypeError, ValueError):
            bus_id = ""
        devices.append(
            control_pb2.Device(
                kind="cuda", index=index, name=props.name, memory_bytes=props.total_memory, pci_bus_id=bus_id
            )
        )
    return devices


def _is_index_list(text: str) -> bool:
    return all(x.strip().isdigit() for x in text.split(","))


def _visible_cuda_indices() -> set[int] | None:
    """Physical indices allowed by CUDA_VISIBLE_DEVICES; None when unset or not numeric
    (GPU UUIDs: the agent cannot map them without the driver, so it filters nothing)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    if visible.strip() == "":
        return set()
    return {int(x) for x in visible.split(",")} if _is_index_list(visible) else None


def host_memory_bytes(meminfo: str = DEFAULT_MEMINFO) -> int:
    """Total host RAM in bytes (``MemTotal`` of /proc/meminfo, falling back to sysconf)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None


def usable_cpu_count() -> int:
    """CPUs this process may run on (affinity mask; honours taskset/cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def hardware_report(
    worker_id: str,
    address: str,
    slots: int,
    cuda_devices: list[control_pb2.Device],
    meminfo: str = DEFAULT_MEMINFO,
    host_share: int = 1,
) -> control_pb2.WorkerRegistration:
    """The registration this node sends first on every session.

    Args:
        worker_id: stable id of this node agent (kept across reconnects).
        address: host:port where this agent's gRPC server is reachable from other nodes.
        slots: rank processes this node may run (one per device).
        cuda_devices: from :func:`detect_cuda_devices`; empty means one "cpu" device
            (named after the CPU model, with the host's RAM as its memory).
        meminfo: where the host's RAM is read (the same file :class:`MemorySampler` reads).
        host_share: node agents sharing this host's RAM (`surgectl up --workers N` starts N on
            one host): each registers 1/N of it, so the allocator's quotas (memory / slots)
            of the host's agents add up to the host, not N times it (fresh37 #7c).

    Raises:
        ValueError: ``slots`` or ``host_share`` < 1.
    """
    if slots < 1:
        raise ValueError(f"worker: slots: must be >= 1, got {slots}")
    if host_share < 1:
        raise ValueError(f"worker: host_share: must be >= 1, got {host_share}")
    memory = host_memory_bytes(meminfo) // host_share
    devices = list(cuda_devices) or [
        control_pb2.Device(kind="cpu", index=0, name=cpu_model_name(), memory_bytes=memory)
    ]
    return control_pb2.WorkerRegistration(
        worker_id=worker_id,
        host=socket.gethostname(),
        address=address,
        devices=devices,
        memory_bytes=memory,
        cpu_count=usable_cpu_count(),
        slots=slots,
    )


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def gloo_interface(advertised: str) -> str | None:
    """The network interface that carries this node's advertised address (``--advertise``,
    the address its peers reach it at), for gloo's ``GLOO_SOCKET_IFNAME``. Left alone, gloo
    binds to what the machine's own name resolves to, which is loopback where /etc/hosts
    says so (containers, network namespaces, many cloud images): a rank then advertises
    127.0.0.1 to its peers on other hosts and its group is never formed. None when it cannot
    be told (a name that does not resolve, not Linux): gloo then chooses as before."""
    try:
        target = socket.getaddrinfo(advertised, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect((target, 9))  # no packet is sent: the kernel picks the route and source
            local = udp.getsockname()[0]
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == local:
                return name
    except OSError:
        return None
    return None


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(raw[20:24])
