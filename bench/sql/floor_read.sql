\set k random(1, 10000)
SELECT response, response_status FROM bench.floor WHERE scope = '' AND key = 'r' || :k;
