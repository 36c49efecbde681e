"""Regenerate train.jsonl and eval.jsonl: hand-written task lists crossed with topics, deduplicated, then split
at random (fixed seed) so that no eval prompt appears in training.

Run: `python -m engine.distill.prompts.make_prompts` (the JSONL files are committed; rerun only to change them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
NUM_EVAL = 60
SEED = 1234

PYTHON = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function to merge two sorted lists into one sorted list.",
    "Write a Python script that counts how often each word appears in a text file.",
    "Write a Python function that returns the n-th Fibonacci number using iteration.",
    "Implement binary search in Python and explain its time complexity.",
    "Write a Python class for a simple stack with push, pop and peek methods.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python script that reads a CSV file and prints the average of the 'price' column.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python decorator that measures how long a function takes to run.",
    "Write a Python function that returns the factorial of a number using recursion.",
    "Write a Python function that finds the largest and smallest numbers in a list without using max or min.",
    "Write a Python generator that yields the squares of the numbers from 1 to n.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python class representing a bank account with deposit and withdraw methods.",
    "Write a Python function that sorts a list of dictionaries by the value of the key 'age'.",
    "Write a Python function that computes the greatest common divisor of two integers.",
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a Python script that renames all .txt files in a folder to .md.",
    "Write a Python function that returns the second largest number in a list.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that splits a list into chunks of size n.",
    "Write a Python function that computes the moving average of a list with a window of 3.",
    "Write a Python function that capitalizes the first letter of every word in a string.",
    "Write a Python script that fetches the current date and prints it as YYYY-MM-DD.",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Implement bubble sort in Python.",
    "Implement quicksort in Python.",
    "Implement a linked list in Python with append and print methods.",
    "Write a Python function that checks whether parentheses in a string are balanced.",
    "Write a Python function that returns all prime numbers below n with the sieve of Eratosthenes.",
    "Explain what a Python list comprehension is and give three examples.",
    "Explain the difference between a list and a tuple in Python.",
    "What does the `with` statement do in Python? Show an example.",
    "Explain Python's `*args` and `**kwargs` with an example.",
    "How do I read a JSON file in Python?",
    "How do I handle exceptions in Python? Give an example with try and except.",
    "Explain the difference between `==` and `is` in Python.",
    "Fix this Python code: `for i in range(10) print(i)`",
    "What is wrong with this Python code? `def add(a, b): return a + b` called as `add(1)`",
    "Write a Python dataclass for a book with a title, an author and a year.",
    "Write a Python function that counts the lines in a file.",
    "Write unit tests with pytest for a function `add(a, b)` that adds two numbers.",
    "Write a Python function that returns the most common element in a list.",
    "Write a Python function that converts a list of tuples into a dictionary.",
    "Write a Python script that prints the multiplication table from 1 to 10.",
    "Write a Python function that checks whether a year is a leap year.",
    "Write a Python function that returns the length of the longest word in a sentence.",
    "Write a Python function that rotates a list by k positions.",
    "Write a Python function that computes the sum of the digits of a number.",
    "Write a Python function that converts a decimal number to binary without using bin().",
    "Write a Python function that finds all pairs in a list that sum to a target value.",
    "Explain what a Python dictionary is and show how to loop over its keys and values.",
    "Explain the difference between a shallow copy and a deep copy in Python.",
    "How do I create and activate a virtual environment in Python?",
    "Write a Python function that reads a text file and returns its lines in reverse order.",
    "Write a Python script that generates a random password of 12 characters.",
    "Explain what a lambda function is in Python, with two examples.",
    "Write a Python function that merges two dictionaries.",
    "Write a Python function that counts how many times each letter appears in a string.",
]

JAVASCRIPT = [
    "Write a JavaScript function that reverses a string.",
    "Write a JavaScript function that returns the sum of an array of numbers.",
    "Write a JavaScript function that debounces another function.",
    "Explain the difference between `let`, `const` and `var` in JavaScript.",
    "Write a JavaScript function that fetches JSON from a URL with async/await.",
    "Write a JavaScript function that removes duplicate values from an array.",
    "Explain what a Promise is in JavaScript with an example.",
    "Write a JavaScript function that capitalizes the first letter of a string.",
    "Write a JavaScript snippet that adds a click handler to a button with the id 'submit'.",
    "Write a JavaScript function that checks whether a number is even.",
    "Explain the difference between `==` and `===` in JavaScript.",
    "Write a JavaScript function that counts the occurrences of each character in a string.",
    "Write a JavaScript function that returns the largest number in an array.",
    "Write a JavaScript function that deep-clones an object.",
    "Explain what closures are in JavaScript with a short example.",
    "Write a JavaScript function that formats a date as DD/MM/YYYY.",
    "Write a simple Express.js server that responds with 'Hello World'.",
    "Write a JavaScript function that filters out all falsy values from an array.",
    "Explain how `map`, `filter` and `reduce` work in JavaScript.",
    "Write a JavaScript function that shuffles an array.",
    "Write a JavaScript class for a counter with increment and reset methods.",
    "Write a JavaScript function that validates a password: at least 8 characters and one digit.",
    "Write a JavaScript function that converts an object into a query string.",
    "Explain what the event loop is in JavaScript.",
    "Write a React component that shows a counter with a button to increase it.",
]

SQL = [
    "Write a SQL query that returns the ten most expensive products from a table `products(id, name, price)`.",
    "Write a SQL query that counts the number of orders per customer in a table `orders(id, customer_id, total)`.",
    "Write a SQL query that finds employees who earn more than the average salary.",
    "Explain the difference between INNER JOIN and LEFT JOIN in SQL.",
    "Write a SQL statement that creates a table `users` with an id, a name, an email and a creation date.",
    "Write a SQL query that returns customers who have never placed an order.",
    "Write a SQL query that returns the total sales per month from a table `sales(id, amount, sold_at)`.",
    "Write a SQL query that finds duplicate email addresses in a table `users`.",
    "Explain what an index is in a database and when to use one.",
    "Write a SQL query that returns the second highest salary from a table `employees`.",
    "Write a SQL query that deletes all rows older than 30 days from a table `logs(id, message, created_at)`.",
    "Explain what GROUP BY and HAVING do in SQL.",
    "Write a SQL query that joins `students`, `courses` and `enrollments` to list each student's courses.",
    "Write a SQL query that updates the price of all products in the category 'books' by 10 percent.",
    "Explain the difference between WHERE and HAVING.",
    "Write a SQL query that returns the number of users who signed up each day last week.",
    "What is a primary key and what is a foreign key?",
    "Write a SQL query that finds the department with the highest average salary.",
    "Explain what database normalization is, with a short example.",
    "Write a SQL query that returns the top three customers by total spending.",
]

BASH = [
    "Write a bash command that finds all files larger than 100 MB in the current directory.",
    "Write a bash script that backs up a folder into a tar.gz file named with today's date.",
    "How do I count the number of lines in all .py files in a directory with bash?",
    "Write a bash one-liner that replaces 'foo' with 'bar' in every .txt file.",
    "Explain what `chmod 755` does.",
    "Write a bash script that checks whether a website is up and prints the HTTP status code.",
    "How do I find which process is using port 8080 on Linux?",
    "Write a bash loop that prints the numbers from 1 to 10.",
    "Explain the difference between `>` and `>>` in bash.",
    "Write a bash script that deletes log files older than 7 days.",
    "How do I search for a word in all files of a directory recursively?",
    "Write a bash script that asks for the user's name and greets them.",
    "Explain what a pipe `|` does in the shell, with an example.",
    "How do I see the disk usage of each folder in the current directory?",
    "Write a bash script that renames all .jpeg files to .jpg.",
    "How do I run a command in the background and keep it running after I log out?",
    "Explain what environment variables are and how to set one in bash.",
    "Write a cron entry that runs a script every day at 3 am.",
    "How do I extract a .tar.gz archive on Linux?",
    "Write a bash script that prints the ten largest files in a directory.",
]

EXPLAIN_TOPICS = [
    "photosynthesis", "how vaccines work", "the water cycle", "black holes", "inflation in economics",
    "how the internet works", "machine learning", "the theory of evolution", "climate change", "how a car engine works",
    "the difference between weather and climate", "why the sky is blue", "how airplanes fly", "compound interest",
    "the French Revolution", "how batteries store energy", "DNA", "the greenhouse effect", "supply and demand",
    "how a computer stores data", "plate tectonics", "the immune system", "gravity", "how solar panels work",
    "blockchain", "the stock market", "how the heart pumps blood", "the Roman Empire", "recursion in programming",
    "how rainbows form", "what a neural network is", "the causes of World War I", "how GPS works",
    "the scientific method", "how bees make honey", "what an API is", "how the moon affects tides",
    "what a recession is", "how sleep affects memory", "the speed of light", "how encryption keeps data safe",
    "what renewable energy is", "how volcanoes erupt", "the Industrial Revolution", "what a cloud server is",
    "how earthquakes happen", "what an atom is made of", "how the stomach digests food", "what a budget is",
    "how elections work in a democracy", "what antibiotics do", "how a refrigerator keeps food cold",
    "what a database is", "how airplanes stay in the air", "what the ozone layer is", "how coffee is made",
    "what a virus is in computing", "how memory works in the brain", "what taxes pay for",
    "how wind turbines generate electricity", "what a programming language is", "how the eye sees color",
    "the life cycle of a butterfly", "what an operating system does", "how money is created",
]
EXPLAIN_FORMS = [
    "Explain {t} in simple terms.",
    "Can you explain {t} to a ten-year-old?",
    "Give me a short explanation of {t}.",
    "What should a beginner know about {t}?",
]

CHAT = [
    "Hi! How are you today?", "What is your favorite book and why?", "Can you recommend a good movie for tonight?",
    "I feel tired all the time. Any tips?", "What should I cook for dinner with rice, eggs and spinach?",
    "How can I get better at public speaking?", "What are some fun things to do on a rainy weekend?",
    "I have a job interview tomorrow. How should I prepare?", "How do I stay motivated when learning something new?",
    "Tell me a joke about programmers.", "What is a good way to start learning the guitar?",
    "Can you help me plan a three-day trip to Rome?", "How do I make new friends in a new city?",
    "What is the best way to learn a new language?", "My plant's leaves are turning yellow. What should I do?",
    "How much water should I drink every day?", "What are some good habits for a productive morning?",
    "Can you suggest a name for my new puppy?", "I can't sleep. What can I do?",
    "What is a healthy breakfast I can make in five minutes?", "How do I ask my boss for a raise?",
    "What hobbies can I start with no money?", "Give me some ideas for a birthday present for my dad.",
    "How do I deal with stress at work?", "What is the difference between a cold and the flu?",
    "Should I learn Python or JavaScript first?", "How do I keep my apartment clean with little time?",
    "What are some good exercises I can do at home?", "Tell me something interesting about octopuses.",
    "What's a good way to save money each month?", "How can I improve my handwriting?",
    "Can you recommend some podcasts about science?", "What is the capital of Australia?",
    "Who painted the Mona Lisa?", "How many planets are in the solar system?",
    "What is the tallest mountain in the world?", "Who wrote 'Pride and Prejudice'?",
    "What language is spoken in Brazil?", "When did the first man land on the moon?",
    "What is the largest ocean on Earth?", "Thanks for your help earlier!",
    "What do you think about remote work?", "How do I politely decline an invitation?",
    "What are some tips for a first date?", "How do I start running if I have never run before?",
]

LIST_ITEMS = [
    "tips for studying effectively", "healthy snacks", "countries in Europe", "programming languages and what they "
    "are used for", "ways to reduce plastic waste", "famous scientists and their discoveries", "benefits of regular "
    "exercise", "things to pack for a beach holiday", "classic novels everyone should read", "ways to save energy at "
    "home", "common interview questions", "fruits high in vitamin C", "ideas for a team-building activity",
    "useful keyboard shortcuts", "reasons to learn a second language", "board games for families", "tips for writing "
    "clean code", "signs of burnout", "vegetables that grow well in pots", "ways to improve your sleep",
    "features of a good website", "steps to start a small business", "historical events of the 20th century",
    "mistakes beginners make when learning to code", "things to do in Paris", "tips for taking better photos with a "
    "phone", "questions to ask before buying a used car", "ways to be more productive", "animals that live in the "
    "Arctic", "uses of artificial intelligence", "tips for learning to cook", "ways to stay focused while working "
    "from home", "famous landmarks in Asia", "good habits for personal finance", "ways to be kind to others",
    "skills every programmer should learn", "ways to reduce stress", "easy houseplants for beginners",
    "tips for a long car trip", "things to check before submitting an essay",
]
LIST_FORMS = ["List five {t}.", "Give me a list of {t}.", "What are some {t}? Give a numbered list.",
              "Name three {t} and say one sentence about each."]

WRITING = [
    "Write a short poem about the ocean.", "Write a haiku about autumn leaves.", "Write a short story about a robot "
    "who learns to paint.", "Write a polite email asking my manager for a day off next Friday.",
    "Write a product description for a stainless steel water bottle.", "Write a thank-you note to a teacher.",
    "Write a short speech for a friend's wedding.", "Write a limerick about a cat who loves cheese.",
    "Write a cover letter opening paragraph for a junior software developer job.", "Write a tweet announcing a new "
    "coffee shop opening.", "Write a short bedtime story about a brave little mouse.", "Write a motivational message "
    "for someone starting a new job.", "Write a review of a fictional Italian restaurant.", "Write a poem about the "
    "city at night.", "Write an email to a customer apologizing for a late delivery.", "Write a short dialogue "
    "between a detective and a suspect.", "Write the opening paragraph of a fantasy novel.", "Write a short "
    "description of a sunset at the beach.", "Write a formal letter complaining about a noisy neighbor.",
    "Write a LinkedIn post about finishing a marathon.", "Write a short story that begins with 'The door was already "
    "open.'", "Write a birthday message for my grandmother.", "Write a slogan for an eco-friendly clothing brand.",
    "Write a short poem about friendship.", "Write an invitation to a summer barbecue.", "Summarize the plot of "
    "Romeo and Juliet in three sentences.", "Summarize the story of Cinderella in one paragraph.", "Rewrite this "
    "sentence to sound more formal: 'Hey, can you send me that stuff by tomorrow?'", "Write a short persuasive "
    "paragraph about why people should read more books.", "Write a two-sentence horror story.",
    "Translate 'Good morning, how are you?' into French, Spanish and German.", "Write a short news report about a "
    "local library reopening.", "Write a recipe for a simple tomato pasta.", "Write a short rap verse about coffee.",
    "Describe your ideal weekend in a short paragraph.", "Write an out-of-office email reply.",
    "Write a short poem about the first snow of winter.", "Write a short story about a lost key.",
    "Write an email inviting my team to a Friday lunch.", "Write a short fable about a fox and a crow.",
    "Write a product description for a pair of running shoes.", "Write a haiku about the moon.",
    "Write a short speech to welcome new students to a school.", "Write a letter to my future self.",
    "Write a short story about a dragon who is afraid of fire.", "Write a short ad for a bicycle repair shop.",
    "Summarize the story of the Three Little Pigs in a few sentences.", "Write a toast for my parents' "
    "anniversary.", "Write a poem about a rainy afternoon in the city.", "Write a job posting for a barista.",
]

NAMES = ["Anna", "Ben", "Carlos", "Dina", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Leo", "Mia",
         "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tara", "Yuki"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "oranges", "cards", "stamps", "candies"]


def math_problems(rng: random.Random, n: int) -> list[str]:
    """Word problems with random numbers: the answers differ, the phrasing repeats like real user traffic."""
    forms = [
        lambda a, b, c, x, y: f"{x} has {a} {y}. She buys {b} more and gives {c} to a friend. How many {y} does she "
                              "have now?",
        lambda a, b, c, x, y: f"A train travels {a * 10} km in {b % 5 + 2} hours. What is its average speed?",
        lambda a, b, c, x, y: f"{x} saves ${a} every week. How much money will {x} have after {b} weeks?",
        lambda a, b, c, x, y: f"A shop sells {y} at ${c % 9 + 1} each. How much do {a} {y} cost?",
        lambda a, b, c, x, y: f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        lambda a, b, c, x, y: f"There are {a + b} students in a class and {a} of them are girls. What percentage of "
                              "the class are boys?",
        lambda a, b, c, x, y: f"{x} reads {c % 20 + 10} pages a day. How many days will it take to finish a book "
                              f"of {a * 30} pages?",
        lambda a, b, c, x, y: f"A jacket costs ${a * 5} and is on sale for {b % 5 * 10 + 10}% off. What is the sale "
                              "price?",
        lambda a, b, c, x, y: f"{x} is {a % 30 + 5} years old. Her mother is {b % 4 + 2} times as old. How old "
                              "is her mother?",
        lambda a, b, c, x, y: f"Solve for x: {a % 9 + 2}x + {b} = {c + b}.",
        lambda a, b, c, x, y: f"What is {a * 7} divided by {a % 6 + 2}? Show your steps.",
        lambda a, b, c, x, y: f"A recipe needs {a % 4 + 2} eggs for {b % 3 + 2} people. How many eggs are needed "
                              f"for {c % 10 + 6} people?",
        lambda a, b, c, x, y: f"{x} runs {a % 8 + 2} km every day. How far does {x} run in {b % 4 + 2} weeks?",
        lambda a, b, c, x, y: f"If {a} workers build a wall in {b % 6 + 3} days, how long do {a * 2} workers need?",
        lambda a, b, c, x, y: f"What is {a % 40 + 10}% of {b * 10}?",
    ]
    out = []
    for i in range(n):
        a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(1, 30)
        out.append(forms[i % len(forms)](a, b, c, rng.choice(NAMES), rng.choice(ITEMS)))
    return out


def build(rng: random.Random) -> list[dict[str, str]]:
    rows: list[tuple[str, str]] = []
    rows += [("code/python", p) for p in PYTHON]
    rows += [("code/javascript", p) for p in JAVASCRIPT]
    rows += [("code/sql", p) for p in SQL]
    rows += [("code/bash", p) for p in BASH]
    rows += [("explain", f.format(t=t)) for t in EXPLAIN_TOPICS for f in rng.sample(EXPLAIN_FORMS, 2)]
    rows += [("chat", p) for p in CHAT]
    rows += [("list", f.format(t=t)) for t in LIST_ITEMS for f in rng.sample(LIST_FORMS, 2)]
    rows += [("writing", p) for p in WRITING]
    rows += [("math", p) for p in math_problems(rng, 110)]
    seen: set[str] = set()
    unique = []
    for cat, p in rows:
        if p not in seen:
            seen.add(p)
            unique.append({"category": cat, "prompt": p})
    rng.shuffle(unique)
    for i, r in enumerate(unique):
        r["id"] = f"p{i:04d}"
    return unique


def main() -> None:
    rows = build(random.Random(SEED))
    splits = {"eval": rows[:NUM_EVAL], "train": rows[NUM_EVAL:]}
    for name, part in splits.items():
        with open(HERE / f"{name}.jsonl", "w") as f:
            for r in sorted(part, key=lambda r: r["id"]):
                f.write(json.dumps({"id": r["id"], "category": r["category"], "prompt": r["prompt"]}) + "\n")
        print(f"{name}: {len(part)} prompts")


if __name__ == "__main__":
    main()
