"""Ray Data reads JSONL from S3 and writes JSONL back (run as a Ray driver by a test)."""

import sys

import ray
from pyarrow import fs


def main() -> None:
    endpoint, bucket = sys.argv[1], sys.argv[2]
    ray.init(address="auto" if "RAY_ADDRESS" in __import__("os").environ else "local",
             include_dashboard=False, log_to_driver=False)
    s3 = fs.S3FileSystem(endpoint_override=endpoint, scheme=endpoint.split("://")[0], region="us-east-1")
    ds = ray.data.read_json(f"{bucket}/rd/in/", filesystem=s3, lines=True)
    ds = ds.map(lambda row: {**row, "doubled": row["n"] * 2})
    ds.write_json(f"{bucket}/rd/out/", filesystem=s3, mode="overwrite")
    print("rows", ds.count())


if __name__ == "__main__":
    main()
