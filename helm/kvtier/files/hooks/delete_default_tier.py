"""`helm uninstall`'s pre-delete hook: delete the default CacheTier while the operator still runs.

The operator (kopf) keeps a finalizer (kvtier.io/finalizer) on every CacheTier and
ModelRecipe it watches: its per-resource timers need one. Helm deletes custom resources
after everything else, so without this hook the operator is gone before the CacheTier and
the CacheTier (with its StatefulSet, Services and pods) would hang in deletion forever.
Here the CacheTier goes first: the operator releases it and Kubernetes' garbage collector
removes what the operator made for it. If the operator does not release it within the
grace time (it is not running), the hook removes the finalizer itself, so uninstall never
hangs.

Usage: python -c "$(cat delete_default_tier.py)" NAMESPACE NAME GRACE_SECONDS
Runs with the operator's ServiceAccount (get, delete and patch on cachetiers); standard
library only. Exit 0 once the CacheTier is gone; 1 with the reason otherwise.
"""

import json
import ssl
import sys
import time
import urllib.error
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
namespace, name, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
url = f"https://kubernetes.default.svc/apis/kvtier.io/v1alpha1/namespaces/{namespace}/cachetiers/{name}"
context = ssl.create_default_context(cafile=f"{SA}/ca.crt")
with open(f"{SA}/token") as f:
    token = f.read().strip()


def call(method, body=None, content_type="application/json"):
    """(HTTP status, parsed body) of one API call; 404 is an answer, not an error."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return 404, {}
        raise


def gone_within(seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if call("GET")[0] == 404:
            return True
        time.sleep(1)
    return call("GET")[0] == 404


status, _ = call("DELETE")
if status == 404:
    print(f"CacheTier {namespace}/{name}: not there")
    sys.exit(0)
if gone_within(grace):
    print(f"CacheTier {namespace}/{name}: deleted (released by the operator)")
    sys.exit(0)
# The operator did not release it (not running?): release it here.
call("PATCH", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
if gone_within(30):
    print(f"CacheTier {namespace}/{name}: deleted (the operator did not release it in {grace:g} s)")
    sys.exit(0)
print(f"CacheTier {namespace}/{name}: still there after its finalizer was removed")
sys.exit(1)
