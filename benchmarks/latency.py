"""See baryon/bench/latency.py; the same as `baryon bench latency`."""

from baryon.bench.latency import main

if __name__ == "__main__":
    main()
