"""The kvtier operator: ModelRecipe and CacheTier custom resources, reconciled by kopf.

One-line map of the modules, in the order a reconcile goes through them:

- ``spec``: parse a custom resource's body into frozen dataclasses (``SpecError`` names the field).
- ``quantity``: Kubernetes quantities (``2Gi``) to bytes and back.
- ``errors``: the operator's error tree.
- ``children``: pure functions from a typed spec to the desired child objects (plain dicts).
- ``conditions``: pure functions from observed objects to status conditions.
- ``kube``: a small async Kubernetes REST client (server-side apply, get, delete).
- ``reconcile``: parse -> desired children -> apply -> observe -> status, for each kind.
- ``handlers``: the kopf handlers, thin wrappers around ``reconcile``.
- ``main``: ``run(argv)``, the ``kvtier operator`` command.

The CRDs are ``crds/*.yaml`` and the RBAC rules ``rbac.yaml`` (both shipped by the Helm chart).
"""

if __name__ == "operator":  # pragma: no cover - a misconfigured interpreter, not a code path
    # This folder is installed as kvtier.operator. Imported as plain "operator",
    # it would shadow the standard library's module of that name: that happens
    # when Python puts the repository root on sys.path (python -c / -m run from it).
    raise ImportError(
        "kvtier's operator/ folder is shadowing the standard library's 'operator' module "
        "(the repository root was on sys.path before the interpreter loaded the standard "
        "one: PYTHONPATH names it, or python -S): keep the root off PYTHONPATH and import "
        "kvtier from the installed package (scripts/setup installs it editable)"
    )
