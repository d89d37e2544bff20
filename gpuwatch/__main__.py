from gpuwatch.cli import main

if __name__ == "__main__":  # guarded: the sampler's spawned child re-imports this module
    raise SystemExit(main())
