from pathlib import Path

from tests_objstores.conftest import wc


def test_prefetch_each(rgw_bucket, gcs_bucket, az_container, tier_env, tiny_model: Path, tmp_path: Path):
    rgw_bucket.upload_dir(tiny_model, "tiny/")
    gname, gfs = gcs_bucket
    gfs.put(str(tiny_model) + "/", f"{gname}/tiny/", recursive=True)
    aname, afs = az_container
    afs.put(str(tiny_model) + "/", f"{aname}/tiny/", recursive=True)
    print(gfs.find(gname), afs.find(aname))
    for uri in (rgw_bucket.uri("tiny/"), f"gs://{gname}/tiny/", f"az://{aname}/tiny/"):
        r = wc("prefetch", uri, "--root", str(tmp_path / uri[:2]), "-o", "json", env=tier_env())
        print(uri, r.returncode, r.stdout[-500:], r.stderr[-3000:])
