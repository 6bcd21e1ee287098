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
