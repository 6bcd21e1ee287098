"""`helm test`: wait until a kvtier tier answers grpc.health.v1 with SERVING.

Usage: python -c "$(cat tier_health.py)" HOST:PORT TIMEOUT_SECONDS [CA_FILE [CERT_FILE KEY_FILE]]
With CA_FILE the check speaks TLS, verifying the tier with that CA, and presents the
client certificate CERT_FILE (key KEY_FILE) to a tier that requires one.
Exit 0 once the tier is SERVING; 1 with the last error when the time is up.
"""

import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

target, timeout = sys.argv[1], float(sys.argv[2])
files = [Path(path).read_bytes() for path in sys.argv[3:]]
ca, cert, key = ([*files, None, None, None])[:3]
credentials = None if ca is None else grpc.ssl_channel_credentials(ca, key, cert)
deadline = time.monotonic() + timeout
last = "no answer"
while True:
    try:
        channel = (
            grpc.insecure_channel(target)
            if credentials is None
            else grpc.secure_channel(target, credentials)
        )
        with channel:
            request = health_pb2.HealthCheckRequest(service="")
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            print(f"the kvtier tier at {target} is SERVING")
            sys.exit(0)
        last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        last = f"{exc.code().name}: {exc.details()}"
    if time.monotonic() >= deadline:
        print(f"the kvtier tier at {target} is not SERVING after {timeout:g} s: {last}")
        sys.exit(1)
    time.sleep(2)
