"""Rules of the offline proposer: the generic ones keyed on the job adapter's knobs (``generic``), merged with a
target's own (``catalog``)."""
