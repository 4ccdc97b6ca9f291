"""Service ``data`` (layer L4): dataset versions and the micro-batch stream to ranks.

Modules (one file each, named after the seed's roles)::

    dataset_versions.py  L4-1  registry of prepared versions, mount + manifest verification
    prefetcher.py        L4-2  the split's catalog and read handle (os.pread on a shared IO pool)
    shuffler.py          L4-3  global epoch order = pure function of (seed, epoch)
    sample_filter.py     L4-4  drops (too short / too long / banned) and counts, nothing else
    batch_packer.py      L4-5  PACK or PAD rows from the sample index, dealt to dp ranks as
                               [micro_batch_size, seq_len] int32, on AssembleBatches{count}

Around them: ``prepare/`` (offline: text, JSONL, Parquet or s3:// sources -> immutable version directory),
``manifest.py`` (sealing and checking manifests), ``sample_index.py`` (the global sample
index: doc/sample/shuffle indices per epoch, memory-mapped, next to the version),
``documents.py`` (the payloads that ride with bus messages: references, no tokens),
``remote_versions.py`` (versions kept in object storage: manifest and small files fetched and
checked) and ``block_cache.py`` (their token files read through a bounded local block cache),
``blend.py`` and ``mixture.py`` (a weighted mixture: the blend rule, and the stream that
deals the blended rows of one ordinary stream per dataset),
``errors.py``, ``server.py`` (gRPC relay) and ``__main__.py`` (the composition root: the
only place modules are built and wired onto the contract bus).

Data path of one stream (every arrow is a route-checked bus message)::

    L2-1 relay --OpenStream--> L4-1 --ActivateSource--> L4-2 --SamplesRead--> L4-3
    L4-3 --SamplesShuffled--> L4-4 --SamplesFiltered--> L4-5 --MicroBatch--> L2-1 relay
    (and L2-1 --SetPrefetch/ShufflePlan/FilterRules/PackerConfig--> L4-2/3/4/5, once;
     L2-1 --AssembleBatches{count}--> L4-5 for each few batches the rank is about to train)
"""
