CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     status TEXT NOT NULL, ordered_at TEXT NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id), product TEXT NOT NULL,
                          qty INTEGER NOT NULL, unit_price_cents INTEGER NOT NULL);
INSERT INTO customers VALUES (1,'Alice Moreau','FR'),(2,'Bob Tanaka','JP'),(3,'Carla Souza','BR'),
  (4,'Dmitri Ivanov','DE'),(5,'Erin O''Neil','IE'),(6,'Farah Khan','GB'),(7,'Gus Lindqvist','SE');
INSERT INTO orders VALUES
  (1,1,'paid','2024-01-03'),(2,1,'paid','2024-02-11'),(3,2,'cancelled','2024-01-05'),
  (4,2,'paid','2024-01-20'),(5,3,'paid','2024-02-02'),(6,3,'refunded','2024-02-09'),
  (7,4,'paid','2024-03-01'),(8,4,'paid','2024-03-15'),(9,5,'cancelled','2024-03-02'),
  (10,5,'paid','2024-03-09'),(11,6,'paid','2024-01-30'),(12,3,'paid','2024-03-20');
INSERT INTO order_items VALUES
  (1,'Headphones',1,7999),(1,'Cable',2,999),(2,'Charger',1,2550),
  (3,'Monitor',1,24900),(4,'Mouse',2,2495),(4,'Mouse pad',1,1200),
  (5,'Keyboard',1,6450),(6,'Webcam',1,8900),(12,'Keyboard cover',3,1200),(12,'Stand',1,1050),
  (7,'Laptop sleeve',1,3500),(7,'Backpack',1,6500),(8,'Cable',1,999),(8,'Adapter',1,1001),
  (9,'Desk',1,19900),(10,'Lamp',4,2500),
  (11,'Chair',1,11000),(11,'Cushion',1,1000);
