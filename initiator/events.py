"""Namespaces and asynchronous events: rescans, AER notices, the ANA log, admin reads."""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Iterable

from blockfabric.initiator.errors import NvmeError
from blockfabric.initiator.namespace import HostNamespace

from blockfabric.errors import BlockfabricError
from blockfabric.protocol import (CQE, OAES_NS_ATTR, ActiveNamespaceList, AsyncEvent,
                                  AsyncEventRequest, AsyncEventType, AsyncNotice,
                                  ChangedNamespaceList, GetLogPage, Identify, IdentifyCNS,
                                  IdentifyNamespace, LogPageId, PropertyGet, PropertySet,
                                  SetFeatures, StatusCode)
from blockfabric.protocol.admin import OAES_ANA_CHANGE
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.identify import CMIC_ANA
from blockfabric.protocol.logpages import ANA_LSP_RGO, unpack_ana_log
from blockfabric.protocol.opcodes import FeatureId

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from blockfabric.initiator.parts import ControllerParts
    from blockfabric.protocol.logpages import AnaGroupDescriptor
else:
    ControllerParts = object    # (the parts' description, for the type checker: parts.py)

#: Bytes of ANA log read: the header, 128 group descriptors and 1024 NSIDs (what the
#: Linux host sizes its buffer to: 16 + NANAGRPID * 32 + MNAN * 4).
ANA_LOG_READ = 16 + 128 * 32 + 1024 * 4
#: Block sizes a namespace may have here: 512 B (LBADS 9) to 64 KiB (LBADS 16).  Smaller
#: ones are not NVMe's (and would let one read need more blocks than a command's 16-bit
#: count holds); larger ones would make a partial write allocate a whole block.
MIN_LBADS, MAX_LBADS = 9, 16
#: The largest namespace, in bytes, a file here can stand for (a signed 64-bit offset).
MAX_NAMESPACE_BYTES = (1 << 63) - 1


def unusable(ident: IdentifyNamespace) -> str | None:
    """Why a namespace's Identify data makes it unusable here (None: it is usable): an
    LBA format it names that is not there, a block size outside MIN_LBADS..MAX_LBADS, or
    a size no file offset holds.  (The Linux host hides such namespaces likewise.)"""
    try:
        bs = ident.block_size
    except ProtocolError as exc:
        return str(exc)
    if not 1 << MIN_LBADS <= bs <= 1 << MAX_LBADS:
        return f"block size {bs} B, outside {1 << MIN_LBADS}..{1 << MAX_LBADS}"
    if ident.nsze * bs > MAX_NAMESPACE_BYTES:
        return f"{ident.nsze} blocks of {bs} B, more than a file offset holds"
    return None


class Events(ControllerParts):
    """The controller's view of its namespaces and what the target tells it unasked:
    rescans, Asynchronous Event Requests, the ANA log, and the admin reads they need."""

    def rescan(self, nsids: Iterable[int] | None = None) -> set[int]:
        """Identify ``nsids`` (None: the active namespace list plus those known) and bring
        ``namespaces`` up to date, changing existing objects in place.  Returns the NSIDs
        that were added, removed or changed."""
        if nsids is None:
            active = ActiveNamespaceList.unpack_from(
                self._identify(IdentifyCNS.ACTIVE_NS_LIST, 0)).nsids
            nsids = set(active) | set(self.namespaces)
        changed = set()
        for nsid in sorted(n for n in nsids if n):
            # One namespace the host cannot use (its Identify refused, or data it cannot
            # serve) costs that namespace only: skipped, the others served (only a failed
            # admin queue fails the whole rescan).
            why = None
            try:
                ident = IdentifyNamespace.unpack_from(
                    self._identify(IdentifyCNS.NAMESPACE, nsid))
            except (NvmeError, ProtocolError) as exc:
                why = f"Identify Namespace failed: {exc}"
            else:
                if ident.nsze:
                    why = unusable(ident)
            ns = self.namespaces.get(nsid)
            if why is not None:
                log.warning("%s: namespace %d skipped: %s", self.opts.subnqn, nsid, why)
                if ns is not None:
                    ns.active = False
                    del self.namespaces[nsid]
                    changed.add(nsid)
                continue
            if ident.nsze == 0:                     # inactive: the all-zero page
                if ns is not None:
                    ns.active = False
                    del self.namespaces[nsid]
                    changed.add(nsid)
                continue
            read_only = bool(ident.nsattr & 1)
            if ns is None:
                self.namespaces[nsid] = HostNamespace(self,  # type: ignore[arg-type]  # (a Controller)
                                                      nsid, ident.block_size, ident.nsze,
                                                  read_only, ident.nguid, ident)
                changed.add(nsid)
            elif (ns.nblocks, ns.block_size, ns.read_only) != (ident.nsze, ident.block_size,
                                                               read_only):
                ns.block_size, ns.nblocks, ns.read_only = ident.block_size, ident.nsze, \
                    read_only
                ns.identify = ident
                changed.add(nsid)
        return changed

    # -- asynchronous events -------------------------------------------------------------
    def _start_events(self) -> None:
        """Ask for namespace attribute notices and keep an AER outstanding."""
        ana = bool(self.identify and self.identify.cmic & CMIC_ANA)
        self.wait(self.admin, SetFeatures(  # type: ignore[arg-type]  # (connected)
            fid=FeatureId.ASYNC_EVENT, value=OAES_NS_ATTR | (
            OAES_ANA_CHANGE if ana else 0)).to_sqe(),
                  "Set Features (asynchronous event configuration)")
        if ana:
            self.read_ana_log()
        if self._events is None:
            self._events = concurrent.futures.ThreadPoolExecutor(1, "nvme-aen")
        self._submit_aer()

    def _submit_aer(self) -> None:
        if self._closed or self.admin is None or self.admin.dead_reason:
            return
        try:
            self.submit(self.admin, AsyncEventRequest().to_sqe(), self._on_aer)
        except (ConnectionError, TimeoutError) as exc:
            log.debug("AER not submitted: %s", exc)

    def _on_aer(self, cqe: CQE | None, _data, error: BaseException | None) -> None:
        """On the reactor: hand the event to the worker (it must wait for commands)."""
        if error is not None or cqe is None or self._closed:
            return
        if cqe.status != StatusCode.SUCCESS:        # 0x4006: the controller is going away
            log.debug("AER completed with %s", cqe.status)
            return
        try:
            event = AsyncEvent.from_int(cqe.result & 0xFFFFFFFF)
        except ProtocolError:       # a reserved event type: nothing to do but ask again
            log.info("asynchronous event %#x of a reserved type ignored",
                     cqe.result & 0xFFFFFFFF)
            self._submit_aer()
            return
        try:
            self._events.submit(  # type: ignore[union-attr]  # (AERs: _start_events made it)
                self._handle_event, event)
        except RuntimeError:                        # closing
            pass

    def _handle_event(self, event: AsyncEvent) -> None:
        changed: set[int] = set()
        try:
            if event.event_type == AsyncEventType.NOTICE \
                    and event.info == AsyncNotice.NS_ATTR_CHANGED:
                # Reading the page clears the target's list: if the rescan after it fails,
                # the next notice rescans everything rather than lose those namespaces.
                full, self._rescan_all = self._rescan_all, True
                page = ChangedNamespaceList.unpack_from(
                    self.get_log_page(LogPageId.CHANGED_NS, 4096))   # re-arms the event
                changed = self.rescan(None if page.overflowed or full else page.nsids)
                self._rescan_all = False
                log.info("namespaces changed: %s", sorted(changed) or "none")
            elif event.event_type == AsyncEventType.NOTICE \
                    and event.info == AsyncNotice.ANA_CHANGE:
                ana = self.read_ana_log()                          # re-arms the event
                log.info("ANA change: chgcnt=%d %s", ana[0],
                         {g.grpid: g.state.name.lower() for g in ana[1]})
                for listener in list(self.ana_listeners):
                    try:
                        listener(self, ana)  # type: ignore[arg-type]  # (self: a Controller)
                    except Exception:
                        log.exception("ANA listener %r failed", listener)
            else:
                log.info("asynchronous event %s ignored", event)
        except (BlockfabricError, ConnectionError, TimeoutError) as exc:
            if not self._closed:
                log.warning("handling %s: %s", event, exc)
            return
        except Exception:   # (a malformed page, say): logged, never lost in the executor
            log.exception("handling %s failed", event)
            return
        finally:
            try:
                self._submit_aer()
            except Exception:   # no AER outstanding means no event is ever seen again
                log.exception("AER not submitted after %s", event)
        for ns_listener in list(self.namespace_listeners):
            try:
                ns_listener(self, changed)  # type: ignore[arg-type]  # (self: a Controller)
            except Exception:  # one subscriber must not starve the others
                log.exception("namespace listener %r failed", ns_listener)

    def ana_log_size(self) -> int:
        """Bytes of ANA log to read: its header, a descriptor per ANA group and an NSID per
        namespace the controller may have (NANAGRPID, MNAN or else NN), as the Linux host
        sizes it; at least ANA_LOG_READ, at most what one command moves."""
        ident = self.identify
        if ident is None:
            return ANA_LOG_READ
        size = 16 + 32 * ident.nanagrpid + 4 * (ident.mnan or ident.nn)
        return min(max(size, ANA_LOG_READ), self.max_transfer)

    def read_ana_log(self, rgo: bool = False) -> tuple[int, list[AnaGroupDescriptor]]:
        """Read the ANA log page (LID 0x0C): (chgcnt, [AnaGroupDescriptor])."""
        size = self.ana_log_size()
        _, data = self.wait(self.admin, GetLogPage(  # type: ignore[arg-type]  # (connected)
            nsid=0xFFFFFFFF, lid=LogPageId.ANA, lsp=ANA_LSP_RGO if rgo else 0,
            numd=GetLogPage.numd_for(size)).to_sqe(), "Get Log Page 0xc", data_in=size)
        self.ana_log = unpack_ana_log(data)  # type: ignore[arg-type]  # (data_in: bytes)
        return self.ana_log

    def _identify(self, cns: IdentifyCNS, nsid: int = 0) -> bytes:
        _, data = self.wait(self.admin,  # type: ignore[arg-type]  # (connected)
                            Identify(nsid=nsid, cns=cns).to_sqe(),
                            f"Identify CNS {int(cns)}", data_in=4096)
        return data  # type: ignore[return-value]  # (data_in: bytes)

    def property_get(self, offset: int, size: int, timeout: float | None = None) -> int:
        cqe, _ = self.wait(self.admin,  # type: ignore[arg-type]  # (connected)
                           PropertyGet(attrib=1 if size == 8 else 0, offset=offset).to_sqe(),
                           f"Property Get {offset:#x}", timeout=timeout)
        return cqe.result if size == 8 else cqe.result & 0xFFFFFFFF

    def property_set(self, offset: int, value: int, timeout: float | None = None) -> None:
        self.wait(self.admin,  # type: ignore[arg-type]  # (connected)
                  PropertySet(attrib=0, offset=offset, value=value).to_sqe(),
                  f"Property Set {offset:#x}", timeout=timeout)

    def get_log_page(self, lid: int, length: int, offset: int = 0, nsid: int = 0,
                     rae: bool = False) -> bytes:
        _, data = self.wait(self.admin, GetLogPage(  # type: ignore[arg-type]  # (connected)
            nsid=nsid, lid=lid, rae=rae, numd=GetLogPage.numd_for(length),
            lpo=offset).to_sqe(), f"Get Log Page {int(lid):#x}", data_in=length)
        return data  # type: ignore[return-value]  # (data_in: bytes)
