"""`python -m singd_curvlinops`: the `singd-curvlinops` command line."""

if __name__ == "__main__":
    from singd_curvlinops.cli import main

    raise SystemExit(main())
