"""See baryon/bench/serve.py; the same as `baryon bench serve`."""

from baryon.bench.serve import main

if __name__ == "__main__":
    main()
