"""kvtier.operator: the kopf operator that deploys cache tiers and vLLM engines."""

if __name__ == "operator":  # pragma: no cover - a misconfigured interpreter, not a code path
    # This folder is installed as kvtier.operator. Imported as plain "operator",
    # it would shadow the standard library's module of that name: that happens
    # when Python puts the repository root on sys.path (python -c / -m run from it).
    raise ImportError(
        "kvtier's operator/ folder is shadowing the standard library's 'operator' module: "
        "run Python with -P (or PYTHONSAFEPATH=1) from the repository root, or from another "
        "directory; the scripts in scripts/ do this for you"
    )
