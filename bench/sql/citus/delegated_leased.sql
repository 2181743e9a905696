\set s random(1, 1000)
\set k random(1, 1000000000000000)
SELECT bench.ins('t:s', 'd:client_id-:k', :k);
SELECT bench.upd('t:s', 'd:client_id-:k');
