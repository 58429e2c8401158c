"""Ray Data reads JSONL from S3 and writes JSONL back (run as a Ray driver by a test)."""

import os
import sys

import ray
from pyarrow import fs


def main() -> None:
    endpoint, bucket = sys.argv[1], sys.argv[2]
    # stay on loopback: without this the driver advertises the machine's external address
    ray.init(
        address=os.environ.get("RAY_ADDRESS", "local"),
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
    )
    # explicit keys: the filesystem object is serialized to the read/write tasks on Ray workers,
    # which do not inherit this driver's environment
    s3 = fs.S3FileSystem(
        endpoint_override=endpoint,
        scheme=endpoint.split("://")[0],
        region="us-east-1",
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
    )
    # pyarrow's JSON reader is newline-delimited JSON (Ray 2.60 refuses filesystem= with lines=True)
    ds = ray.data.read_json(f"{bucket}/rd/in/", filesystem=s3)
    ds = ds.map(lambda row: {**row, "doubled": row["n"] * 2})
    ds.write_json(f"{bucket}/rd/out/", filesystem=s3, mode=ray.data.SaveMode.OVERWRITE)
    print("rows", ds.count())


if __name__ == "__main__":
    main()
