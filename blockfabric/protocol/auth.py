"""In-band authentication: DH-HMAC-CHAP (NVMe base 2.0 section 8.13, TP 8006).

Wire facts follow Linux (include/linux/nvme.h, drivers/nvme/common/auth.c, host/auth.c,
target/fabrics-cmd-auth.c):

* Authentication Send (fctype 0x05) and Receive (0x06) carry SPSP0 @41, SPSP1 @42 (both 1),
  SECP @43 (0xE9, DH-HMAC-CHAP) and TL/AL @44; the message is the command's data.
* A Connect response whose result has ATR (bit 17) set asks the host to authenticate that
  queue; until it has, the controller answers every command but Fabrics ones with
  AUTH_REQUIRED (0x191) | DNR.  Every queue (admin and I/O) authenticates on its own.
* Host: AUTH_Negotiate -> Challenge -> Reply -> Success1 (-> Success2 when the host also
  authenticated the controller).  A failure is Failure1 (controller to host, common message
  type) or Failure2 (host to controller), after which the controller is torn down.
* Responses: HMAC(Kh', Ca || SEQ (le32) || TID (le16) || SC_C (0) || "HostHost" || NQNh || 0 ||
  NQNc) for the host; the controller's uses its own key, "Controller" and the NQNs swapped.
  Kh' is the secret transformed with the NQN (HMAC(key, NQN || "NVMe-over-Fabrics") with the
  secret's own hash) unless the secret says "no transform".  With a DH group, Ca is
  HMAC(H(g^xy mod p), C), else the challenge C itself.

Nothing here does I/O: the target keeps one :class:`TargetAuth` per queue and feeds it the
messages; the host runs :func:`host_authenticate` with two callables that move the bytes.

Why one module of ~800 lines: DH-HMAC-CHAP is one exchange whose host and controller sides
check each other's messages; the message formats, the secret transform, the FFDHE groups
and both state machines are kept side by side so that each wire fact is written once.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import hashlib
import hmac
import secrets
import struct
import zlib
from typing import Callable

from blockfabric.protocol._wire import Packed, packed, raw, u8, u16, u32
from blockfabric.protocol.capsule import Command, cmd, command
from blockfabric.protocol.opcodes import FABRICS_OPCODE, FabricsType

SECP_DHCHAP = 0xE9  # security protocol: NVMe DH-HMAC-CHAP
SPSP_DHCHAP = 0x01  # SPSP0 and SPSP1 both 1
AUTH_ID_DHCHAP = 0x01  # protocol descriptor authid
CONNECT_AUTHREQ_ATR = 1 << 17  # Connect result: authentication transaction required
CONNECT_AUTHREQ_ASCR = 1 << 18  # ... and a secure channel (TLS): not supported here
#: What a host asks for in Authentication Receive (the Linux host: one 4 KiB buffer).
RECEIVE_SIZE = 4096
SC_C_NONE = 0  # secure channel concatenation: none


class AuthType(enum.IntEnum):
    """Message byte 0."""

    COMMON = 0x00
    DHCHAP = 0x01


class AuthMsg(enum.IntEnum):
    """Message byte 1 (auth_id)."""

    NEGOTIATE = 0x00
    CHALLENGE = 0x01
    REPLY = 0x02
    SUCCESS1 = 0x03
    SUCCESS2 = 0x04
    FAILURE2 = 0xF0
    FAILURE1 = 0xF1


class HashId(enum.IntEnum):
    """HMAC hash functions (kernel NVME_AUTH_HASH_*)."""

    SHA256 = 0x01
    SHA384 = 0x02
    SHA512 = 0x03


class DhGroup(enum.IntEnum):
    """Diffie-Hellman groups (kernel NVME_AUTH_DHGROUP_*)."""

    NULL = 0x00
    FFDHE2048 = 0x01
    FFDHE3072 = 0x02
    FFDHE4096 = 0x03
    FFDHE6144 = 0x04
    FFDHE8192 = 0x05


class Explanation(enum.IntEnum):
    """Failure reason code explanation (rescode_exp); rescode itself is always 1."""

    FAILED = 0x01
    NOT_USABLE = 0x02
    CONCAT_MISMATCH = 0x03
    HASH_UNUSABLE = 0x04
    DHGROUP_UNUSABLE = 0x05
    INCORRECT_PAYLOAD = 0x06
    INCORRECT_MESSAGE = 0x07


RESCODE_FAILED = 0x01

HASH_NAMES: dict[int, str] = {HashId.SHA256: "sha256", HashId.SHA384: "sha384",
                              HashId.SHA512: "sha512"}
HASH_LENGTHS: dict[int, int] = {HashId.SHA256: 32, HashId.SHA384: 48, HashId.SHA512: 64}
DHGROUP_NAMES: dict[int, str] = {DhGroup.NULL: "null", DhGroup.FFDHE2048: "ffdhe2048",
                                  DhGroup.FFDHE3072: "ffdhe3072", DhGroup.FFDHE4096: "ffdhe4096",
                                  DhGroup.FFDHE6144: "ffdhe6144", DhGroup.FFDHE8192: "ffdhe8192"}
#: The groups this implementation computes (NULL: HMAC-CHAP only).
SUPPORTED_DHGROUPS = (DhGroup.NULL, DhGroup.FFDHE2048)


class AuthError(Exception):
    """Authentication failed; ``explanation`` goes into Failure1/Failure2."""

    def __init__(self, message: str, explanation: Explanation = Explanation.FAILED) -> None:
        super().__init__(message)
        self.explanation = explanation


# --------------------------------------------------------------------------- the commands

@command(FABRICS_OPCODE, FabricsType.AUTH_SEND)
class AuthSend(Command):
    """Authentication Send: the host's message is the command's data (``tl`` bytes)."""

    spsp0: int = cmd(41, 8, default=SPSP_DHCHAP)  # @41
    spsp1: int = cmd(42, 8, default=SPSP_DHCHAP)  # @42
    secp: int = cmd(43, 8, default=SECP_DHCHAP)  # @43 security protocol
    tl: int = cmd(44, 32)  # @44 transfer length


@command(FABRICS_OPCODE, FabricsType.AUTH_RECEIVE)
class AuthReceive(Command):
    """Authentication Receive: the controller's message comes back as ``al`` bytes."""

    spsp0: int = cmd(41, 8, default=SPSP_DHCHAP)  # @41
    spsp1: int = cmd(42, 8, default=SPSP_DHCHAP)  # @42
    secp: int = cmd(43, 8, default=SECP_DHCHAP)  # @43
    al: int = cmd(44, 32)  # @44 allocation length


# --------------------------------------------------------------------------- the messages

IDLIST_HALF = 30  # hash ids in idlist[0..29], DH group ids in idlist[30..59]


@packed(72)
class Negotiate(Packed):
    """AUTH_Negotiate with its one DH-HMAC-CHAP protocol descriptor (8 + 64 bytes)."""

    auth_type: int = u8(0, AuthType.COMMON)  # @0
    auth_id: int = u8(1, AuthMsg.NEGOTIATE)  # @1; @2 reserved
    t_id: int = u16(4)  # @4 transaction id
    sc_c: int = u8(6)  # @6 secure channel concatenation
    napd: int = u8(7, 1)  # @7 number of protocol descriptors
    authid: int = u8(8, AUTH_ID_DHCHAP)  # @8 descriptor: protocol; @9 reserved
    halen: int = u8(10)  # @10 hash ids listed
    dhlen: int = u8(11)  # @11 DH group ids listed
    hash_list: bytes = raw(12, IDLIST_HALF)  # @12 idlist[0..29]
    dh_list: bytes = raw(42, IDLIST_HALF)  # @42 idlist[30..59]

    @classmethod
    def offer(cls, t_id: int, hashes: tuple[int, ...], groups: tuple[int, ...]) -> Negotiate:
        return cls(t_id=t_id, halen=len(hashes), dhlen=len(groups),
                   hash_list=bytes(hashes).ljust(IDLIST_HALF, b"\0"),
                   dh_list=bytes(groups).ljust(IDLIST_HALF, b"\0"))

    @property
    def hash_ids(self) -> tuple[int, ...]:
        return tuple(self.hash_list[:self.halen])

    @property
    def dh_groups(self) -> tuple[int, ...]:
        return tuple(self.dh_list[:self.dhlen])


@packed(16)
class ChallengeHeader(Packed):
    """DH-HMAC-CHAP_Challenge; then ``hl`` bytes of C1 and ``dhvlen`` of g^y mod p."""

    auth_type: int = u8(0, AuthType.DHCHAP)  # @0
    auth_id: int = u8(1, AuthMsg.CHALLENGE)  # @1
    t_id: int = u16(4)  # @4
    hl: int = u8(6)  # @6 hash length
    hashid: int = u8(8)  # @8
    dhgid: int = u8(9)  # @9
    dhvlen: int = u16(10)  # @10
    seqnum: int = u32(12)  # @12 S1


@packed(16)
class ReplyHeader(Packed):
    """DH-HMAC-CHAP_Reply; then R1 (``hl``), C2 (``hl``, zero unless ``cvalid``), g^x."""

    auth_type: int = u8(0, AuthType.DHCHAP)  # @0
    auth_id: int = u8(1, AuthMsg.REPLY)  # @1
    t_id: int = u16(4)  # @4
    hl: int = u8(6)  # @6
    cvalid: int = u8(8)  # @8 C2 valid: the host authenticates the controller too
    dhvlen: int = u16(10)  # @10
    seqnum: int = u32(12)  # @12 S2 (0: no controller authentication)


@packed(16)
class Success1Header(Packed):
    """DH-HMAC-CHAP_Success1; then R2 (``hl`` bytes) when ``rvalid``."""

    auth_type: int = u8(0, AuthType.DHCHAP)  # @0
    auth_id: int = u8(1, AuthMsg.SUCCESS1)  # @1
    t_id: int = u16(4)  # @4
    hl: int = u8(6)  # @6
    rvalid: int = u8(8)  # @8; @9..15 reserved


@packed(16)
class Success2(Packed):
    """DH-HMAC-CHAP_Success2: the host accepted the controller's response."""

    auth_type: int = u8(0, AuthType.DHCHAP)  # @0
    auth_id: int = u8(1, AuthMsg.SUCCESS2)  # @1
    t_id: int = u16(4)  # @4; @6..15 reserved


@packed(8)
class Failure(Packed):
    """AUTH_Failure1 (controller to host) or AUTH_Failure2 (host to controller)."""

    auth_type: int = u8(0, AuthType.COMMON)  # @0
    auth_id: int = u8(1, AuthMsg.FAILURE1)  # @1
    t_id: int = u16(4)  # @4
    rescode: int = u8(6, RESCODE_FAILED)  # @6 reason code
    rescode_exp: int = u8(7, Explanation.FAILED)  # @7 explanation


@dataclasses.dataclass(frozen=True)
class Challenge:
    """A whole Challenge message."""

    t_id: int
    hashid: int
    seqnum: int
    c1: bytes
    dhgid: int = DhGroup.NULL
    dh_value: bytes = b""

    def pack(self) -> bytes:
        head = ChallengeHeader(t_id=self.t_id, hl=len(self.c1), hashid=self.hashid,
                               dhgid=self.dhgid, dhvlen=len(self.dh_value),
                               seqnum=self.seqnum)
        return head.pack() + self.c1 + self.dh_value

    @classmethod
    def unpack(cls, buf: bytes) -> Challenge:
        head = ChallengeHeader.unpack_from(_need(buf, ChallengeHeader.SIZE, "Challenge"))
        _expect(head, AuthType.DHCHAP, AuthMsg.CHALLENGE)
        body = _need(buf, ChallengeHeader.SIZE + head.hl + head.dhvlen, "Challenge")
        c1 = body[16:16 + head.hl]
        return cls(head.t_id, head.hashid, head.seqnum, bytes(c1), head.dhgid,
                   bytes(body[16 + head.hl:16 + head.hl + head.dhvlen]))


@dataclasses.dataclass(frozen=True)
class Reply:
    """A whole Reply message (``c2`` empty: no controller authentication)."""

    t_id: int
    response: bytes
    seqnum: int = 0
    c2: bytes = b""
    dh_value: bytes = b""

    def pack(self) -> bytes:
        hl = len(self.response)
        head = ReplyHeader(t_id=self.t_id, hl=hl, cvalid=1 if self.c2 else 0,
                           dhvlen=len(self.dh_value), seqnum=self.seqnum)
        return head.pack() + self.response + (self.c2 or bytes(hl)) + self.dh_value

    @classmethod
    def unpack(cls, buf: bytes) -> Reply:
        head = ReplyHeader.unpack_from(_need(buf, ReplyHeader.SIZE, "Reply"))
        _expect(head, AuthType.DHCHAP, AuthMsg.REPLY)
        hl = head.hl
        body = _need(buf, ReplyHeader.SIZE + 2 * hl + head.dhvlen, "Reply")
        c2 = bytes(body[16 + hl:16 + 2 * hl]) if head.cvalid else b""
        return cls(head.t_id, bytes(body[16:16 + hl]), head.seqnum, c2,
                   bytes(body[16 + 2 * hl:16 + 2 * hl + head.dhvlen]))


@dataclasses.dataclass(frozen=True)
class Success1:
    """A whole Success1 message (``response`` empty unless the controller answers C2)."""

    t_id: int
    hl: int
    response: bytes = b""

    def pack(self) -> bytes:
        head = Success1Header(t_id=self.t_id, hl=self.hl, rvalid=1 if self.response else 0)
        return head.pack() + self.response

    @classmethod
    def unpack(cls, buf: bytes) -> Success1:
        head = Success1Header.unpack_from(_need(buf, Success1Header.SIZE, "Success1"))
        _expect(head, AuthType.DHCHAP, AuthMsg.SUCCESS1)
        if not head.rvalid:
            return cls(head.t_id, head.hl)
        body = _need(buf, Success1Header.SIZE + head.hl, "Success1")
        return cls(head.t_id, head.hl, bytes(body[16:16 + head.hl]))


def _need(buf: bytes, size: int, what: str) -> bytes:
    if len(buf) < size:
        raise AuthError(f"{what}: {len(buf)} bytes, need {size}", Explanation.INCORRECT_PAYLOAD)
    return buf


def _expect(head: Packed, auth_type: int, auth_id: int) -> None:
    got = (getattr(head, "auth_type"), getattr(head, "auth_id"))
    if got != (auth_type, auth_id):
        raise AuthError(f"message {got[0]:#x}/{got[1]:#x}, expected {auth_type:#x}/"
                        f"{auth_id:#x}", Explanation.INCORRECT_MESSAGE)


def message_kind(buf: bytes) -> tuple[int, int]:
    """(auth_type, auth_id) of a message; AuthError if it has not even those."""
    if len(buf) < 2:
        raise AuthError("message shorter than 2 bytes", Explanation.INCORRECT_PAYLOAD)
    return buf[0], buf[1]


def failure_of(buf: bytes) -> Failure | None:
    """The Failure1/Failure2 in ``buf``, or None if it is another message."""
    if len(buf) >= Failure.SIZE and buf[0] == AuthType.COMMON and buf[1] in (
            AuthMsg.FAILURE1, AuthMsg.FAILURE2):
        return Failure.unpack_from(buf)
    return None


# --------------------------------------------------------------------------- secrets

SECRET_PREFIX = "DHHC-1:"
KEY_LENGTHS = (32, 48, 64)


@dataclasses.dataclass(frozen=True)
class Secret:
    """A DH-HMAC-CHAP secret: the key and how it is transformed (0 none, else a HashId).

    Text form (what ``nvme gen-dhchap-key`` prints): ``DHHC-1:XX:<base64(key || crc32)>:``.
    ``repr`` hides the key, so a secret never lands in a log line by accident.
    """

    key: bytes = dataclasses.field(repr=False)
    transform: int = 0

    @classmethod
    def parse(cls, text: str) -> Secret:
        """Parse the text form; ValueError says what is wrong with it."""
        if not isinstance(text, str) or not text.startswith(SECRET_PREFIX):
            raise ValueError(f"a secret starts with {SECRET_PREFIX!r}")
        rest = text[len(SECRET_PREFIX):]
        if len(rest) < 3 or rest[2] != ":" or not rest[:2].isdigit():
            raise ValueError("after 'DHHC-1:' come two digits and ':' (00 none, 01 SHA-256, "
                             "02 SHA-384, 03 SHA-512)")
        transform = int(rest[:2])
        if transform not in (0, *HASH_NAMES):
            raise ValueError(f"transform {rest[:2]} is not 00, 01, 02 or 03")
        body = rest[3:]
        if body.endswith(":"):
            body = body[:-1]
        try:
            blob = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the key part is not valid base64") from None
        if len(blob) - 4 not in KEY_LENGTHS:
            raise ValueError(f"the key is {max(len(blob) - 4, 0)} bytes; it must be 32, 48 or "
                             "64 (plus a 4-byte CRC)")
        key, crc = blob[:-4], blob[-4:]
        if struct.unpack("<I", crc)[0] != zlib.crc32(key):
            raise ValueError("the CRC-32 after the key does not match (a mistyped secret?)")
        return cls(key, transform)

    def __str__(self) -> str:
        blob = self.key + struct.pack("<I", zlib.crc32(self.key))
        return f"{SECRET_PREFIX}{self.transform:02d}:{base64.b64encode(blob).decode()}:"

    def transformed(self, nqn: str) -> bytes:
        """Kh' (or Kc'): the key as the HMAC key of the response, bound to ``nqn``."""
        if not self.transform:
            return self.key
        return hmac.new(self.key, nqn.encode() + b"NVMe-over-Fabrics",
                        HASH_NAMES[HashId(self.transform)]).digest()


def generate_secret(key_length: int = 32, transform: int = 0) -> Secret:
    """A new random secret (as ``nvme gen-dhchap-key``)."""
    if key_length not in KEY_LENGTHS:
        raise ValueError(f"key length {key_length}: 32, 48 or 64")
    if transform not in (0, *HASH_NAMES):
        raise ValueError(f"transform {transform}: 0 (none), 1, 2 or 3")
    return Secret(secrets.token_bytes(key_length), transform)


# --------------------------------------------------------------------------- computations

def _hmac(hash_id: int, key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, HASH_NAMES[HashId(hash_id)]).digest()


def _response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, t_id: int,
              label: bytes, nqn1: str, nqn2: str) -> bytes:
    data = (challenge + struct.pack("<IHB", seqnum, t_id, SC_C_NONE) + label + nqn1.encode()
            + b"\0" + nqn2.encode())
    return _hmac(hash_id, key, data)


def host_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, t_id: int,
                  hostnqn: str, subnqn: str) -> bytes:
    """R1: what the host proves it holds its key with (``key`` already transformed)."""
    return _response(hash_id, key, challenge, seqnum, t_id, b"HostHost", hostnqn, subnqn)


def controller_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, t_id: int,
                        subnqn: str, hostnqn: str) -> bytes:
    """R2: the controller's answer to C2 (``key``: the controller key transformed with the
    subsystem NQN)."""
    return _response(hash_id, key, challenge, seqnum, t_id, b"Controller", subnqn, hostnqn)


def augmented_challenge(hash_id: int, session_key: bytes, challenge: bytes) -> bytes:
    """Ca = HMAC(H(g^xy mod p), C): the challenge bound to the DH exchange."""
    hashed = hashlib.new(HASH_NAMES[HashId(hash_id)], session_key).digest()
    return _hmac(hash_id, hashed, challenge)


# RFC 7919 appendix A.1, ffdhe2048: p = 2^2048 - 2^1984 + (floor(2^1918 * e) + 560316) * 2^64
# - 1, g = 2.  The test suite recomputes it from that formula and checks it is a safe prime.
FFDHE2048_P = int(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE"
    "249B3EF97D2FE363630C75D8F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3"
    "B557135E7F57C935984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797ABC0AB182"
    "B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D70"
    "9E02FCE1CDF7E2ECC03404CD28342F619172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC"
    "2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA886B423861285C97FFFFFFFFFFFFFFFF", 16)
DH_GENERATOR = 2
DH_PRIVATE_BITS = 512  # >= 2 x the 112-bit strength of ffdhe2048 (RFC 7919 section 5.2)
_DH_PRIMES = {DhGroup.FFDHE2048: FFDHE2048_P}


def dh_size(group: int) -> int:
    """Bytes of a public value (and of the shared secret) in ``group``."""
    return (_DH_PRIMES[DhGroup(group)].bit_length() + 7) // 8


def dh_keypair(group: int) -> tuple[int, bytes]:
    """(private exponent, public value g^x mod p as big-endian bytes of the group's size)."""
    p = _DH_PRIMES[DhGroup(group)]
    private = secrets.randbits(DH_PRIVATE_BITS) | 1 << (DH_PRIVATE_BITS - 1)
    return private, pow(DH_GENERATOR, private, p).to_bytes(dh_size(group), "big")


def dh_shared(group: int, private: int, peer: bytes) -> bytes:
    """g^xy mod p from our private exponent and the peer's public value; a public value
    outside 2..p-2 (which would force a known secret) is refused."""
    p = _DH_PRIMES[DhGroup(group)]
    if len(peer) != dh_size(group):
        raise AuthError(f"DH value of {len(peer)} bytes, need {dh_size(group)}",
                        Explanation.INCORRECT_PAYLOAD)
    y = int.from_bytes(peer, "big")
    if not 1 < y < p - 1:
        raise AuthError("DH public value outside 2..p-2", Explanation.INCORRECT_PAYLOAD)
    return pow(y, private, p).to_bytes(dh_size(group), "big")


def _nonzero_seqnum() -> int:
    return secrets.randbelow(0xFFFFFFFF) + 1


# --------------------------------------------------------------------------- controller side

@dataclasses.dataclass(frozen=True)
class AuthPolicy:
    """What a controller requires of one host (from the target configuration)."""

    host_secret: Secret
    ctrl_secret: Secret | None = None
    hash_id: int = HashId.SHA256
    dhgroup: int = DhGroup.NULL


#: Negotiates a queue may send before a Reply that verifies: the first and one start over
MAX_RESTARTS = 2


class TargetAuth:
    """One queue's DH-HMAC-CHAP transaction on the controller side, step by step as nvmet
    (fabrics-cmd-auth.c): :meth:`send` takes an Authentication Send's data, :meth:`receive`
    makes an Authentication Receive's.  ``authenticated`` says the queue may run commands;
    ``failed`` that the exchange failed (``reason``, ``explanation``), and ``fatal`` that
    the controller is to be torn down once the answer is out."""

    def __init__(self, policy: AuthPolicy, hostnqn: str, subnqn: str) -> None:
        self.policy = policy
        self.hostnqn = hostnqn
        self.subnqn = subnqn
        self.step = AuthMsg.NEGOTIATE
        self.authenticated = False
        self.fatal = False
        self.explanation = Explanation.FAILED
        self.reason = ""
        self.t_id = -1
        self.hash_id = policy.hash_id
        self.dhgroup = policy.dhgroup
        self._c1 = b""
        self._s1 = 0
        self._c2 = b""
        self._s2 = 0
        self._dh_private = 0
        self._session_key = b""
        #: Negotiates taken since the last transaction that completed (see send)
        self.restarts = 0

    @property
    def failed(self) -> bool:
        """The exchange failed: all that is left is to answer Failure1 and end."""
        return self.step == AuthMsg.FAILURE1 or self.step == AuthMsg.FAILURE2

    # -- helpers --------------------------------------------------------------------
    def _fail1(self, reason: str, explanation: Explanation) -> None:
        """The host learns of it from the next Receive (Failure1), then the end."""
        self.step = AuthMsg.FAILURE1
        self.explanation = explanation
        self.reason = reason
        self.authenticated = False

    def _fail_now(self, reason: str) -> None:
        """A message out of sequence: nvmet ends the controller right away."""
        self.step = AuthMsg.FAILURE2
        self.explanation = Explanation.INCORRECT_MESSAGE
        self.reason = reason
        self.authenticated = False
        self.fatal = True

    # -- Authentication Send ----------------------------------------------------------
    def send(self, data: bytes) -> None:
        """The host's message (the command itself completes successfully).  After a
        failure nothing is taken any more, not even a Negotiate to start over (nvmet would
        take one): a host that sent a wrong answer ends its controller whatever it sends
        next, so each guess costs a new controller."""
        if self.failed:
            self.fatal = True
            return
        try:
            auth_type, auth_id = message_kind(data)
        except AuthError as exc:
            self._fail_now(str(exc))
            return
        if auth_type == AuthType.COMMON:
            if auth_id == AuthMsg.NEGOTIATE:
                # (re)start; a queue that authenticated before keeps working meanwhile, and
                # a failure of the new transaction ends the controller anyway.  Once: each
                # start costs a Diffie-Hellman key pair when the challenge is fetched, on
                # the target's loop, and a peer that starts over and over without ever
                # answering would keep it busy until auth_timeout (a Linux host starts
                # over only when the first start went unanswered)
                if self.restarts >= MAX_RESTARTS:
                    self._fail_now(f"a transaction started {self.restarts + 1} times "
                                   "without an answer")
                    return
                self.restarts += 1
                self.step = AuthMsg.NEGOTIATE
            elif auth_id == AuthMsg.FAILURE2:
                failure = failure_of(data)
                exp = failure.rescode_exp if failure else 0
                self._fail_now(f"the host gave up (Failure2, explanation {exp:#x})")
                return
            else:
                self._fail_now(f"common message {auth_id:#x} in step {self.step.name}")
                return
            try:
                self._negotiate(data)
            except AuthError as exc:
                self._fail1(str(exc), exc.explanation)
            else:
                self.step = AuthMsg.CHALLENGE
            return
        if auth_type != AuthType.DHCHAP or auth_id != self.step:
            self._fail_now(f"message {auth_type:#x}/{auth_id:#x} in step {self.step.name}")
            return
        if len(data) < 6 or struct.unpack_from("<H", data, 4)[0] != self.t_id:
            self._fail1("transaction id does not match", Explanation.INCORRECT_PAYLOAD)
            return
        if auth_id == AuthMsg.REPLY:
            try:
                self._reply(data)
            except AuthError as exc:
                self._fail1(str(exc), exc.explanation)
            else:
                self.step = AuthMsg.SUCCESS1
                self.restarts = 0           # (a host that knows the secret)
        elif auth_id == AuthMsg.SUCCESS2:
            self.authenticated = True
            self.step = AuthMsg.NEGOTIATE           # done; a new transaction may follow
        else:
            self._fail_now(f"message {auth_id:#x} from a host")

    def _negotiate(self, data: bytes) -> None:
        if len(data) < Negotiate.SIZE:
            raise AuthError("Negotiate shorter than 72 bytes", Explanation.INCORRECT_PAYLOAD)
        neg = Negotiate.unpack_from(data)
        self.t_id = neg.t_id
        if neg.sc_c != SC_C_NONE:
            raise AuthError("secure channel concatenation is not supported",
                            Explanation.CONCAT_MISMATCH)
        if neg.napd != 1:
            raise AuthError(f"{neg.napd} protocol descriptors, not 1",
                            Explanation.HASH_UNUSABLE)
        if neg.authid != AUTH_ID_DHCHAP or neg.halen > IDLIST_HALF or neg.dhlen > IDLIST_HALF:
            raise AuthError("not a DH-HMAC-CHAP descriptor", Explanation.INCORRECT_PAYLOAD)
        usable = [h for h in neg.hash_ids if h in HASH_NAMES]
        if self.policy.hash_id in neg.hash_ids:
            self.hash_id = self.policy.hash_id
        elif usable:
            self.hash_id = usable[0]                # as nvmet: the host's first usable one
        else:
            raise AuthError("no hash function in common", Explanation.HASH_UNUSABLE)
        if self.policy.dhgroup not in neg.dh_groups:
            raise AuthError(f"the host does not offer DH group "
                            f"{DHGROUP_NAMES.get(self.policy.dhgroup, self.policy.dhgroup)}",
                            Explanation.DHGROUP_UNUSABLE)
        self.dhgroup = self.policy.dhgroup

    def _reply(self, data: bytes) -> None:
        reply = Reply.unpack(data)
        hl = HASH_LENGTHS[HashId(self.hash_id)]
        if len(reply.response) != hl:
            raise AuthError(f"response of {len(reply.response)} bytes, need {hl}",
                            Explanation.INCORRECT_PAYLOAD)
        if self.dhgroup != DhGroup.NULL:
            if not reply.dh_value:
                raise AuthError("no DH value in the Reply", Explanation.INCORRECT_PAYLOAD)
            self._session_key = dh_shared(self.dhgroup, self._dh_private, reply.dh_value)
        elif reply.dh_value:
            raise AuthError("a DH value with the NULL group", Explanation.INCORRECT_PAYLOAD)
        challenge = self._c1
        if self._session_key:
            challenge = augmented_challenge(self.hash_id, self._session_key, challenge)
        key = self.policy.host_secret.transformed(self.hostnqn)
        expected = host_response(self.hash_id, key, challenge, self._s1, self.t_id,
                                 self.hostnqn, self.subnqn)
        if not hmac.compare_digest(expected, reply.response):
            raise AuthError("the host's response does not match (wrong secret?)",
                            Explanation.FAILED)
        self._s2 = reply.seqnum
        self._c2 = reply.c2 if reply.seqnum else b""
        if not self._c2:
            self.authenticated = True

    # -- Authentication Receive -------------------------------------------------------
    def receive(self, al: int) -> bytes:
        """The message for an Authentication Receive of ``al`` bytes (zero padded).  An
        ``al`` too small for it is an AuthError that leaves the transaction where it was."""
        need = self._receive_size()
        if al < need:
            raise AuthError(f"allocation length {al}, the message is {need} bytes")
        if self.step == AuthMsg.CHALLENGE:
            msg = self._challenge()
            self.step = AuthMsg.REPLY
        elif self.step == AuthMsg.SUCCESS1:
            msg = self._success1()
        else:
            if self.step != AuthMsg.FAILURE1:
                self._fail1(f"Authentication Receive in step {self.step.name}",
                            Explanation.FAILED)
            msg = Failure(auth_id=AuthMsg.FAILURE1, t_id=max(self.t_id, 0) & 0xFFFF,
                          rescode_exp=self.explanation).pack()
            self.fatal = True
        return msg.ljust(al, b"\0")

    def _receive_size(self) -> int:
        """Bytes of the message the next Receive returns (nvmet checks AL the same way)."""
        hl = HASH_LENGTHS.get(self.hash_id, 0)
        if self.step == AuthMsg.CHALLENGE:
            dh = dh_size(self.dhgroup) if self.dhgroup != DhGroup.NULL else 0
            return ChallengeHeader.SIZE + hl + dh
        if self.step == AuthMsg.SUCCESS1:
            return Success1Header.SIZE + (hl if self._c2 else 0)
        return Failure.SIZE

    def _challenge(self) -> bytes:
        hl = HASH_LENGTHS[HashId(self.hash_id)]
        self._c1 = secrets.token_bytes(hl)
        self._s1 = _nonzero_seqnum()
        self._session_key = b""
        dh_value = b""
        if self.dhgroup != DhGroup.NULL:
            self._dh_private, dh_value = dh_keypair(self.dhgroup)
        return Challenge(self.t_id & 0xFFFF, self.hash_id, self._s1, self._c1, self.dhgroup,
                         dh_value).pack()

    def _success1(self) -> bytes:
        hl = HASH_LENGTHS[HashId(self.hash_id)]
        response = b""
        if self._c2:
            if self.policy.ctrl_secret is None:
                self._fail1("the host asked the controller to authenticate, and it has no "
                            "controller secret for this host", Explanation.FAILED)
                self.fatal = True
                return Failure(auth_id=AuthMsg.FAILURE1, t_id=self.t_id & 0xFFFF,
                               rescode_exp=Explanation.FAILED).pack()
            challenge = self._c2
            if self._session_key:
                challenge = augmented_challenge(self.hash_id, self._session_key, challenge)
            key = self.policy.ctrl_secret.transformed(self.subnqn)
            response = controller_response(self.hash_id, key, challenge, self._s2,
                                           self.t_id, self.subnqn, self.hostnqn)
            self.step = AuthMsg.SUCCESS2
        else:
            self.step = AuthMsg.NEGOTIATE
        return Success1(self.t_id & 0xFFFF, hl, response).pack()


# --------------------------------------------------------------------------- host side

@dataclasses.dataclass(frozen=True)
class AuthResult:
    """How a queue authenticated."""

    hash_id: int
    dhgroup: int
    bidirectional: bool


def host_authenticate(send: Callable[[bytes], None], receive: Callable[[int], bytes], *,
                      t_id: int, hostnqn: str, subnqn: str, secret: Secret,
                      ctrl_secret: Secret | None = None) -> AuthResult:
    """Run one DH-HMAC-CHAP transaction as the Linux host does; ``send(msg)`` and
    ``receive(al)`` move the bytes with Authentication Send/Receive.  Raises AuthError (after
    telling the controller with Failure2 where the protocol says so)."""
    send(Negotiate.offer(t_id, tuple(HASH_NAMES), SUPPORTED_DHGROUPS).pack())
    data = receive(RECEIVE_SIZE)
    _raise_failure1(data, "Challenge")
    try:
        chal = Challenge.unpack(data)
        if chal.t_id != t_id:
            raise AuthError(f"Challenge for transaction {chal.t_id}, not {t_id}",
                            Explanation.INCORRECT_MESSAGE)
        if chal.hashid not in HASH_NAMES or len(chal.c1) != HASH_LENGTHS[HashId(chal.hashid)]:
            raise AuthError(f"hash {chal.hashid:#x} with {len(chal.c1)}-byte challenge",
                            Explanation.HASH_UNUSABLE)
        challenge, c2, s2, dh_public = chal.c1, b"", 0, b""
        session_key = b""
        if chal.dhgid != DhGroup.NULL:
            if chal.dhgid not in SUPPORTED_DHGROUPS or not chal.dh_value:
                raise AuthError(f"DH group {chal.dhgid:#x}", Explanation.DHGROUP_UNUSABLE)
            private, dh_public = dh_keypair(chal.dhgid)
            session_key = dh_shared(chal.dhgid, private, chal.dh_value)
            challenge = augmented_challenge(chal.hashid, session_key, challenge)
        elif chal.dh_value:
            raise AuthError("a DH value with the NULL group", Explanation.INCORRECT_PAYLOAD)
        response = host_response(chal.hashid, secret.transformed(hostnqn), challenge,
                                 chal.seqnum, t_id, hostnqn, subnqn)
        if ctrl_secret is not None:
            c2 = secrets.token_bytes(len(chal.c1))
            s2 = _nonzero_seqnum()
    except AuthError as exc:
        _failure2(send, t_id, exc)
        raise
    send(Reply(t_id, response, s2, c2, dh_public).pack())
    data = receive(RECEIVE_SIZE)
    _raise_failure1(data, "Success1")
    try:
        ok = Success1.unpack(data)
        if ok.t_id != t_id or ok.hl != len(chal.c1):
            raise AuthError("Success1 for another transaction or hash",
                            Explanation.INCORRECT_MESSAGE)
        if ctrl_secret is not None:
            if not ok.response:
                raise AuthError("the controller did not answer the host's challenge")
            challenge2 = c2
            if session_key:
                challenge2 = augmented_challenge(chal.hashid, session_key, c2)
            expected = controller_response(chal.hashid, ctrl_secret.transformed(subnqn),
                                           challenge2, s2, t_id, subnqn, hostnqn)
            if not hmac.compare_digest(expected, ok.response):
                raise AuthError("the controller's response does not match: it does not hold "
                                "the controller secret")
    except AuthError as exc:
        _failure2(send, t_id, exc)
        raise
    if ctrl_secret is not None:
        send(Success2(t_id=t_id).pack())
    return AuthResult(chal.hashid, chal.dhgid, ctrl_secret is not None)


def _raise_failure1(data: bytes, waiting_for: str) -> None:
    failure = failure_of(data)
    if failure is not None:
        try:
            why = Explanation(failure.rescode_exp).name.lower().replace("_", " ")
        except ValueError:
            why = f"explanation {failure.rescode_exp:#x}"
        known = failure.rescode_exp in set(Explanation)
        raise AuthError(f"the controller refused authentication ({why}) instead of sending "
                        f"{waiting_for}", Explanation(failure.rescode_exp) if known
                        else Explanation.FAILED)


def _failure2(send: Callable[[bytes], None], t_id: int, exc: AuthError) -> None:
    try:
        send(Failure(auth_id=AuthMsg.FAILURE2, t_id=t_id, rescode_exp=exc.explanation).pack())
    except Exception:  # the queue is going anyway; the original error is what matters
        pass
