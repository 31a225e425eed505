"""Store lease holders: one registry that names and describes every holder, so no layer above parses another's.

    holder                       who                           its record (weightcache/store/book.py)
    csi:<volume file id>         a published CSI volume        csi/volumes/<url-quoted file id>.json
    dra:<claim uid>/<device>     a prepared DRA device         dra/claims/<claim uid>.json
    anything else                a CLI or API lease            none: the holder id is its own description

The CSI plugin (weightcache/csi/reconcile.py) and the DRA driver (weightcache/dra/claims.py) name their leases
here; `weightcache evict` and the daemon's API describe any holder here without loading either service. The
prefixes are defined once in weightcache/vocabulary.py.
"""

from __future__ import annotations

import hashlib
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightcache.errors import NewerRecordError
from weightcache.store.book import RecordBook
from weightcache.store.fsops import Tree
from weightcache.vocabulary import CSI_HOLDER_PREFIX, DRA_HOLDER_PREFIX

MAX_QUOTED_ID = 200  # a quoted id becomes one file name (record, lease): NAME_MAX is 255 bytes
CSI_RECORDS = ("csi", "volumes")
DRA_RECORDS = ("dra", "claims")
# record versions (MAJOR, MINOR), weightcache/store/book.py: a minor adds fields older releases keep, a major is a
# change they must refuse (docs/upgrade.md, "Node-state records")
CSI_RECORD_VERSION = (1, 0)
DRA_RECORD_VERSION = (1, 0)


def file_id(volume_id: str) -> str:
    """The volume id as it names files: itself when its quoted form fits a file name, else `sha256-<hex>`. CSI
    allows any 128 bytes, and '%' or 'é' triple when quoted."""
    if len(urllib.parse.quote(volume_id, safe="")) <= MAX_QUOTED_ID:
        return volume_id
    return "sha256-" + hashlib.sha256(volume_id.encode()).hexdigest()


def volume_record_name(volume_id: str) -> str:
    """A volume record's file name: the quoted file id, a leading '.' quoted too (never a hidden or temp name)."""
    quoted = urllib.parse.quote(file_id(volume_id), safe="")
    return "%2E" + quoted[1:] if quoted.startswith(".") else quoted


def csi_holder(volume_id: str) -> str:
    """The store lease holder id of a published CSI volume."""
    return CSI_HOLDER_PREFIX + file_id(volume_id)


def dra_holder(claim_uid: str, device: str) -> str:
    """The store lease holder id of one prepared DRA device."""
    return f"{DRA_HOLDER_PREFIX}{claim_uid}/{device}"


def claim_of_holder(holder: str) -> str | None:
    """The claim uid of a `dra:` lease holder, or None for another holder."""
    if not holder.startswith(DRA_HOLDER_PREFIX):
        return None
    return holder[len(DRA_HOLDER_PREFIX):].partition("/")[0] or None


def describe_volume(*, volume_id: str, target_path: str, pod_namespace: str, pod_name: str, pod_uid: str) -> str:
    """Human words for a published CSI volume: which pod mounts it, where."""
    pod = f"pod {pod_namespace}/{pod_name}" if pod_name else f"pod uid {pod_uid or '?'}"
    return f"{pod} (CSI volume {volume_id} at {target_path})"


def describe_holder(store: Tree | str | Path, holder: str) -> str:
    """Human words for a lease holder, for `weightcache evict` and the API's 409: which pod or claim holds it.
    `store` is the store's tree, or its root resolved as the store resolves it."""
    tree = store if isinstance(store, Tree) else Tree(Path(store).resolve())
    if holder.startswith(CSI_HOLDER_PREFIX):
        volume = holder[len(CSI_HOLDER_PREFIX):]
        book = RecordBook(tree, *CSI_RECORDS, fields=_VOLUME_WORDS, version=CSI_RECORD_VERSION, durable=False)
        words = _newer_or(lambda: book.get(volume_record_name(volume), _volume_words))
        return words or f"CSI volume {volume}"
    if (uid := claim_of_holder(holder)) is not None:
        device = holder.partition("/")[2]
        claims = RecordBook(tree, *DRA_RECORDS, fields=_CLAIM_WORDS, version=DRA_RECORD_VERSION)
        claim = _newer_or(lambda: claims.get(uid, _claim_words)) if _plain(uid) else None
        return f"{claim or f'ResourceClaim uid {uid}'} (DRA device {device})"
    return holder


_VOLUME_WORDS = ("volume_id", "target_path", "pod_namespace", "pod_name", "pod_uid")
_CLAIM_WORDS = ("namespace", "name")


def _newer_or(read: Callable[[], str | None]) -> str | None:
    try:
        return read()
    except NewerRecordError:
        return None  # a newer release's record: the holder's bare name says enough here


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".")


def _volume_words(obj: Any) -> str:
    """Read a CSI volume record only for its words (weightcache.csi.reconcile parses it whole)."""
    return describe_volume(volume_id=str(obj["volume_id"]), target_path=str(obj["target_path"]),
                           pod_namespace=str(obj.get("pod_namespace", "")), pod_name=str(obj.get("pod_name", "")),
                           pod_uid=str(obj.get("pod_uid", "")))


def _claim_words(obj: Any) -> str:
    """Read a DRA claim record only for its words (weightcache.dra.claims parses it whole)."""
    return f"ResourceClaim {obj['namespace']}/{obj['name']}"
