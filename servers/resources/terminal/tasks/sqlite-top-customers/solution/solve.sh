#!/bin/bash
set -euo pipefail
cd /app
sqlite3 shop.db > answer.txt <<'SQL'
SELECT c.name, printf('%.2f', SUM(i.qty * i.unit_price_cents) / 100.0)
FROM customers c
JOIN orders o ON o.customer_id = c.id AND o.status = 'paid'
JOIN order_items i ON i.order_id = o.id
GROUP BY c.id
HAVING SUM(i.qty * i.unit_price_cents) > 10000
ORDER BY SUM(i.qty * i.unit_price_cents) DESC, c.name ASC;
SQL
cat answer.txt
