"""The farm's signature on the code it hands to agents, and the agents' check of it.

A device agent loads native code it downloads: kernels (built by the build workers) and
tuned model libraries (built by the scheduler). A false lease service, or anything on
the path to it, could serve any shared library instead, and its constructor would run
on the board as the agent's user. So the build side signs every such file, and an agent
loads nothing whose signature does not verify with the farm's public key:

    signature = Ed25519(private key, "tunefarm artifact v1\\n<kind>\\n<id>\\n<sha256 hex>")

`kind` and `id` name what the file is for (`SignedKind.KERNEL` and the batch candidate
it was built as, `SignedKind.MODEL_LIBRARY` and its model run), so a signature does not
verify for another file or kind; `sha256` is the file's, computed by the agent over the
bytes it received. A confirmation measures a kernel built as another candidate: its
`ArtifactRef.signed_as` names that candidate. What the check guarantees is that an agent
runs only code the farm built; which candidate's results it reports is the lease
service's word either way. Rows keep the signature as hex (`BatchCandidate.artifact_signature`,
`ModelRun.library_signature`); `ArtifactRef.signature` carries it to the agent.

Keys are PEM files: the private key (PKCS8, mode 0600) only where artifacts are built
(build workers, the scheduler: TUNEFARM_SIGNING_KEY_FILE), the public key on every agent
(TUNEFARM_AGENT_SIGNING_PUBLIC_KEY). `ensure_key_pair` makes a pair (`tunefarm farm
signing-key`, `farm up`); the same with the openssl command:

    openssl genpkey -algorithm ed25519 -out farm-signing.key && chmod 600 farm-signing.key
    openssl pkey -in farm-signing.key -pubout -out farm-signing.pub

Task data and a model run's inputs are not signed: they are arrays read without
pickle (`allow_pickle=False`), never code. The ONNX graph a model run's peers are timed
on (`SignedKind.MODEL_ONNX`) is signed like code although it is data: onnxruntime and
OpenVINO parse it with large native parsers (a crafted protobuf is their attack surface)
and follow its external-data paths, so an agent hands them only a graph the farm sent.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

MESSAGE_HEADER = b"tunefarm artifact v1"
"""First line of every signed message (a signature made for anything else never verifies)."""

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
"""A sha256 as rows and messages write it: 64 lower-case hex digits."""


class SignedKind(StrEnum):
    """What a signed file is for; the id signed with it names which one."""

    KERNEL = "kernel"  # id: the batch candidate
    MODEL_LIBRARY = "model_library"  # id: the model run
    MODEL_ONNX = "model_onnx"  # the ONNX graph a model run's peers are timed on; id: the model run


class SigningError(Exception):
    """Root of the signing errors."""


class KeyFileError(SigningError):
    """A key file that cannot be read, or is not an Ed25519 key of the expected kind."""


class BadSignature(SigningError):
    """A file without a signature, or whose signature does not verify: never load it."""


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 (hex) of a file's bytes: what a signature covers."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def signed_message(kind: SignedKind, artifact_id: int, sha256: str) -> bytes:
    """The bytes signed for a file; `ValueError` for a sha256 that is not 64 hex digits."""
    if not SHA256_HEX.fullmatch(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
    return b"\n".join((MESSAGE_HEADER, str(kind).encode(), str(int(artifact_id)).encode(), sha256.encode()))


@dataclass(frozen=True)
class ArtifactSigner:
    """Signs files with the farm's private key (build workers, the scheduler)."""

    key: Ed25519PrivateKey

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ArtifactSigner:
        """Raises `KeyFileError` for a file that is not a PEM Ed25519 private key."""
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except OSError as exc:
            raise KeyFileError(f"cannot read the signing key {path}: {exc.strerror}") from None
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise KeyFileError(f"{path} is not a PEM private key without a password") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} is not an Ed25519 private key")
        return cls(key)

    def sign(self, kind: SignedKind, artifact_id: int, sha256: str) -> bytes:
        return self.key.sign(signed_message(kind, artifact_id, sha256))

    def sign_file(self, kind: SignedKind, artifact_id: int, path: str | os.PathLike[str]) -> bytes:
        return self.sign(kind, artifact_id, file_sha256(path))


@dataclass(frozen=True)
class ArtifactVerifier:
    """Checks signatures with the farm's public key (agents)."""

    key: Ed25519PublicKey

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ArtifactVerifier:
        """Raises `KeyFileError` for a file that is not a PEM Ed25519 public key."""
        try:
            key = serialization.load_pem_public_key(Path(path).read_bytes())
        except OSError as exc:
            raise KeyFileError(f"cannot read the signing public key {path}: {exc.strerror}") from None
        except (ValueError, UnsupportedAlgorithm):
            raise KeyFileError(f"{path} is not a PEM public key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeyFileError(f"{path} is not an Ed25519 public key")
        return cls(key)

    def verify(self, kind: SignedKind, artifact_id: int, sha256: str, signature: bytes) -> None:
        """Raises `BadSignature` unless `signature` is the farm's over this file."""
        if not signature:
            raise BadSignature(f"the {kind} is not signed")
        try:
            self.key.verify(signature, signed_message(kind, artifact_id, sha256))
        except (InvalidSignature, ValueError):
            raise BadSignature(f"the {kind}'s signature does not verify with the farm's public key") from None


def public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def ensure_key_pair(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str]) -> bool:
    """Make a key pair unless `private_path` exists (then its public key is written to
    `public_path` again); True when a new pair was made. The private key is created
    mode 0600 (never readable by others, not even for a moment). Raises `KeyFileError`."""
    private_path, public_path = Path(private_path), Path(public_path)
    created = False
    if private_path.exists():
        key = ArtifactSigner.from_file(private_path).key
    else:
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        try:
            private_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
        except OSError as exc:
            raise KeyFileError(f"cannot write the signing key {private_path}: {exc.strerror}") from None
        created = True
    try:
        public_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = public_path.with_name(public_path.name + ".tmp")
        tmp.write_bytes(public_pem(key))
        os.chmod(tmp, 0o644)
        os.replace(tmp, public_path)
    except OSError as exc:
        raise KeyFileError(f"cannot write the public key {public_path}: {exc.strerror}") from None
    return created
