"""The cluster tests' probe (standard library only).

probe.py serve PORT          HTTP: /healthz -> "ok", / -> "<hostname> uid=<uid>"
probe.py resolve NAME        print NAME's IPv4 addresses (the pod's resolver)
probe.py get URL             print the body of an HTTP GET
probe.py kube PATH           GET https://kubernetes.default.svc/PATH with the pod's
                             ServiceAccount token and CA; print the body
probe.py write FILE TEXT     write TEXT to FILE
probe.py read FILE           print FILE
"""

import http.server
import os
import signal
import socket
import ssl
import sys
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = (
            b"ok"
            if self.path == "/healthz"
            else f"{socket.gethostname()} uid={os.getuid()}".encode()
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        pass


def main(cmd: str, *args: str) -> None:
    if cmd == "serve":
        # PID 1 in a container gets no default signal handlers: exit on SIGTERM.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        http.server.ThreadingHTTPServer(("0.0.0.0", int(args[0])), Handler).serve_forever()
    elif cmd == "resolve":
        print(
            "\n".join(sorted({a[4][0] for a in socket.getaddrinfo(args[0], None, socket.AF_INET)}))
        )
    elif cmd == "get":
        with urllib.request.urlopen(args[0], timeout=10) as resp:
            print(resp.read().decode())
    elif cmd == "kube":
        ctx = ssl.create_default_context(cafile=f"{SA}/ca.crt")
        with open(f"{SA}/token") as f:
            token = f.read().strip()
        req = urllib.request.Request(f"https://kubernetes.default.svc/{args[0].lstrip('/')}")
        req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            print(resp.read().decode())
    elif cmd == "write":
        with open(args[0], "w") as f:
            f.write(args[1])
    elif cmd == "read":
        with open(args[0]) as f:
            print(f.read())
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(*sys.argv[1:])
