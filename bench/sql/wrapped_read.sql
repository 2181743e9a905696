\set k random(1, 10000)
SELECT * FROM bench.wrapped_read('r' || :k);
