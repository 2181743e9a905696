\set k random(1, 10000)
SELECT * FROM bench.ref_claim('r' || :k, '{"amount": 100, "currency": "EUR"}');
