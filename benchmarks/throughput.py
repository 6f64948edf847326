"""See baryon/bench/throughput.py; the same as `baryon bench throughput`."""

from baryon.bench.throughput import main

if __name__ == "__main__":
    main()
